"""Worker for the FSDP2 tests (2 gloo ranks): a wrapped model against the same model unwrapped."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from rlmath.fused_head import FusedLMHeadLogProbs
from rlmath.hf import response_log_probs
from tests.hf.models import batch, model

R = 4


def _full(g):
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _wrap(m, mode):
    if mode in ("head", "both"):
        fully_shard(m.lm_head)
    if mode in ("root", "both"):
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
    return m


def response_case(name: str, mode: str) -> dict[str, float]:
    """Each rank takes half the batch; FSDP2 averages the gradients over the two ranks."""
    ref = model(name, dtype=torch.float32)
    m = _wrap(copy.deepcopy(ref), mode)
    ids, mask = batch(B=4, prompt=3, response=R)
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    lp, ent = response_log_probs(m, ids[mine], mask[mine], R, temperature=0.8)
    (lp.sum() + 0.5 * ent.sum()).backward()
    rlp, rent = response_log_probs(ref, ids, mask, R, temperature=0.8)
    ((rlp.sum() + 0.5 * rent.sum()) / 2).backward()
    out = {"lp": (lp - rlp[mine]).abs().max().item(), "ent": (ent - rent[mine]).abs().max().item()}
    # Parameters FSDP2 manages get the averaged gradient; with only the head wrapped,
    # the others keep this rank's own gradient, so only the head is compared then.
    want = dict(ref.named_parameters())
    for n, p in m.named_parameters():
        if mode == "head" and not n.startswith("lm_head"):
            continue
        out[n] = (_full(p.grad) - want[n].grad).abs().max().item()
    return out


class _Policy(torch.nn.Module):
    """A model whose forward runs the base model and the fused head (the head sharded by the parent)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.fused = FusedLMHeadLogProbs(lm.lm_head)

    def forward(self, ids, labels):
        hidden = self.lm.model(input_ids=ids).last_hidden_state
        return self.fused(hidden, labels)


def fused_module_case(mode: str) -> dict[str, float]:
    ref = model("llama", dtype=torch.float32)
    ids, _ = batch(B=4, prompt=3, response=R)
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    labels = ids[:, 1:]
    if mode == "head":  # the head alone is wrapped; the module is called outside any forward
        m = copy.deepcopy(ref)
        fully_shard(m.lm_head)
        hidden = m.model(input_ids=ids[mine, :-1]).last_hidden_state
        lp, ent = FusedLMHeadLogProbs(m.lm_head)(hidden, labels[mine])
        params = m.named_parameters()
    else:  # the parent is wrapped; the module runs inside the parent's forward
        policy = _Policy(copy.deepcopy(ref))
        for layer in policy.lm.model.layers:
            fully_shard(layer)
        fully_shard(policy)
        lp, ent = policy(ids[mine, :-1], labels[mine])
        params = policy.lm.named_parameters()
    (lp.sum() + ent.sum()).backward()
    href = ref.model(input_ids=ids[:, :-1]).last_hidden_state
    rlp, rent = FusedLMHeadLogProbs(ref.lm_head)(href, labels)
    ((rlp.sum() + rent.sum()) / 2).backward()
    out = {"lp": (lp - rlp[mine]).abs().max().item()}
    want = dict(ref.named_parameters())
    for n, p in params:
        if mode == "head" and not n.startswith("lm_head"):
            continue
        out[n] = (_full(p.grad) - want[n].grad).abs().max().item()
    return out


def worker() -> dict[str, dict[str, float]]:
    res = {}
    # A tied head shares its weight with the embedding: FSDP2 can shard it only with
    # the module that holds both (the root), so tied models are wrapped at the root.
    for name, modes in (
        ("qwen2", ("root",)),
        ("gemma2", ("root",)),
        ("llama", ("root", "head", "both")),
        ("granite", ("head", "both")),
    ):
        for mode in modes:
            res[f"{name}-{mode}"] = response_case(name, mode)
    res["fused-head"] = fused_module_case("head")
    res["fused-parent"] = fused_module_case("parent")
    dist.barrier()  # every rank leaves together, its collectives complete
    return res
