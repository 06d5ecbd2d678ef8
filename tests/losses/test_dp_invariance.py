"""The key property: data parallelism + gradient accumulation reproduce the full-batch gradient.

Simulated on CPU in plain Python: the batch is split over 4 ranks x 2
gradient-accumulation micro-batches of uneven sizes (and padding widths), with
ragged lengths and fully masked sequences. Each micro-batch loss is computed
with the global counts and ``dp_size=4``; gradients are summed over micro-batches
and averaged over ranks (what DDP/FSDP do). For every aggregation mode and
every policy loss (and the value and entropy losses) the result equals the
single-process full-batch gradient in fp64.

Clip-Cov and KL-Cov choose their tokens from statistics of the batch they are
given (means over the batch, a count proportional to its size, a random or
top-k choice), so they are *not* decomposable across micro-batches; here they
are tested with the selection fixed from the full batch (``selection=``),
which is the exact statement that holds. GSPO's and GMPO's per-sequence terms
only involve one sequence, so they decompose like token losses.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from rlmath import (
    clip_cov_selection,
    compute_entropy_loss,
    compute_value_loss,
    get_policy_loss,
    global_batch_info,
    kl_cov_selection,
    list_policy_losses,
    prompt_batch_info,
)
from rlmath.distributed import run_distributed

from .dp_loss_workers import dp_policy_worker, fixed_selection
from .dp_loss_workers import global_batch as dist_global_batch
from .helpers import LOSS_KWARGS, MODES, agg_extra, policy_batch

RANKS, MICRO = 4, 2
B, T = 20, 9
TOL = dict(rtol=1e-6, atol=1e-6)  # a loose bound; fp64 agreement is ~1e-15 in practice


def _partition(seed: int) -> list[torch.Tensor]:
    """RANKS*MICRO non-empty micro-batches of uneven sizes over shuffled rows."""
    gen = torch.Generator().manual_seed(seed + 99)
    perm = torch.randperm(B, generator=gen)
    cuts = torch.randperm(B - 1, generator=gen)[: RANKS * MICRO - 1].add(1).sort().values
    bounds = [0, *cuts.tolist(), B]
    return [perm[bounds[k] : bounds[k + 1]] for k in range(RANKS * MICRO)]


def _width(mask: torch.Tensor, extra: int) -> int:
    """A padded width for a micro-batch: its last valid column + 1 + extra, at most T."""
    cols = mask.any(dim=0).nonzero()
    last = int(cols.max()) + 1 if cols.numel() else 1
    return min(T, last + extra)


def _simulate(loss_fn, tensors: dict, leaf_name: str, seed: int):
    """Full-batch gradient vs DP-simulated gradient of ``loss_fn(**micro_tensors, **agg_kwargs)``."""
    mask = tensors["mask"]
    # prompt-mean: rows 2k and 2k + 1 answer prompt k; the shuffled partition below
    # spreads a prompt's rows over ranks and micro-batches, so the per-prompt token
    # counts and the prompt count must be those of the whole step.
    prompts = prompt_batch_info(mask, (torch.arange(mask.shape[0]) // 2).tolist())
    full_leaf = tensors[leaf_name].clone().requires_grad_()
    full = dict(tensors, **{leaf_name: full_leaf})
    loss_full = loss_fn(full, dict(norm_length=T, prompt_num_tokens=prompts["prompt_num_tokens"]))
    loss_full.backward()

    dp_leaf = tensors[leaf_name].clone().requires_grad_()
    dp = dict(tensors, **{leaf_name: dp_leaf})
    info = global_batch_info(mask)
    total = torch.zeros((), dtype=torch.float64)
    for k, rows in enumerate(_partition(seed)):
        w = _width(mask[rows], extra=k % 3)
        micro = {name: x[rows][:, :w] for name, x in dp.items()}
        loss = loss_fn(
            micro,
            dict(
                norm_length=T,
                dp_size=RANKS,
                global_num_tokens=info["global_num_tokens"],
                global_num_seqs=info["global_num_seqs"],
                prompt_num_tokens=prompts["prompt_num_tokens"][rows],
                global_num_prompts=prompts["global_num_prompts"],
            ),
        )
        loss.backward()  # gradient accumulation: grads add up across micro-batches
        total = total + loss.detach()
    grad = dp_leaf.grad / RANKS  # DDP averages over ranks
    torch.testing.assert_close(total / RANKS, loss_full.detach(), **TOL)
    torch.testing.assert_close(grad, full_leaf.grad, **TOL)
    return full_leaf.grad


def test_partition_is_uneven_and_covers_everything():
    parts = _partition(0)
    assert len(parts) == RANKS * MICRO
    assert sorted(torch.cat(parts).tolist()) == list(range(B))
    assert len({len(p) for p in parts}) > 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list_policy_losses())
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_losses_are_exact_under_dp(name, mode, with_weights):
    seed = zlib.crc32(f"{name}{mode}".encode()) % 1000
    old, logp, adv, mask = policy_batch(B, T, seed, empty_rows=(1, 7, 8), scale=0.5)
    tensors = {"old": old, "logp": logp, "adv": adv, "mask": mask}
    if with_weights:
        gen = torch.Generator().manual_seed(seed)
        tensors["w"] = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    kwargs = dict(LOSS_KWARGS[name])
    if name in ("clip_cov", "kl_cov"):
        select = clip_cov_selection if name == "clip_cov" else kl_cov_selection
        gen = torch.Generator().manual_seed(seed)
        tensors["sel"] = select(old, logp, adv, mask, generator=gen, **kwargs)
        assert tensors["sel"].any()

    def loss_fn(t, agg):
        extra = {"selection": t["sel"]} if "sel" in t else {}
        loss, _ = get_policy_loss(name)(
            t["old"], t["logp"], t["adv"], t["mask"],
            loss_agg_mode=mode, rollout_is_weights=t.get("w"), **agg, **kwargs, **extra,
        )  # fmt: skip
        return loss

    grad = _simulate(loss_fn, tensors, "logp", seed)
    assert grad.abs().sum() > 0  # the property is not vacuous


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_is_exact_under_dp(mode):
    gen = torch.Generator().manual_seed(5)
    _, _, _, mask = policy_batch(B, T, 5, empty_rows=(0, 3))
    vp, ret, val = (torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(3))
    tensors = {"vp": vp, "ret": ret, "val": val, "mask": mask}

    def loss_fn(t, agg):
        return compute_value_loss(
            t["vp"], t["ret"], t["val"], t["mask"], cliprange_value=0.3, loss_agg_mode=mode, **agg
        )[0]

    _simulate(loss_fn, tensors, "vp", 5)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss_is_exact_under_dp(mode):
    gen = torch.Generator().manual_seed(6)
    _, _, _, mask = policy_batch(B, T, 6, empty_rows=(4,))
    logits = torch.randn(B, T, 5, generator=gen, dtype=torch.float64) * 2
    tensors = {"logits": logits, "mask": mask}

    def loss_fn(t, agg):
        return compute_entropy_loss(t["logits"], t["mask"], loss_agg_mode=mode, **agg)[0]

    _simulate(loss_fn, tensors, "logits", 6)


def test_cov_losses_are_not_decomposable_without_a_fixed_selection():
    """Documented limitation: local selection on micro-batches differs from the full batch."""
    old, logp, adv, mask = policy_batch(B, T, 3, scale=0.5)
    full = kl_cov_selection(old, logp, adv, mask, kl_cov_ratio=0.2)
    local = torch.zeros_like(full)
    for rows in _partition(3):
        local[rows] = kl_cov_selection(
            old[rows], logp[rows], adv[rows], mask[rows], kl_cov_ratio=0.2
        )
    assert not torch.equal(full, local)


REAL_CASES = [
    ("vanilla", "token-mean"),
    ("gspo", "seq-mean-token-mean"),
    ("geo_mean", "seq-mean-token-sum-norm"),
    ("cispo", "seq-mean-token-sum"),
]


def _check_real_ranks(results, seed, cases, world):
    old, logp, adv, mask = dist_global_batch(seed)
    for k, (name, mode) in enumerate(cases):
        leaf = logp.clone().requires_grad_()
        selection = fixed_selection(name, old, logp, adv, mask)
        extra = {} if selection is None else {"selection": selection}
        loss, _ = get_policy_loss(name)(
            old, leaf, adv, mask, loss_agg_mode=mode, **agg_extra(mask), **LOSS_KWARGS[name],
            **extra,
        )  # fmt: skip
        loss.backward()
        for rank_results in results:
            res = rank_results[k]
            assert res["dp_size"] == world
            assert res["tokens"].item() == mask.sum().item()
            torch.testing.assert_close(res["loss"], loss.detach(), **TOL)
            torch.testing.assert_close(res["grad"], leaf.grad, **TOL)


@pytest.mark.integration
def test_real_gloo_ranks_match_single_process():
    """4 real processes, global counts all-reduced by global_batch_info over the group."""
    results = run_distributed(dp_policy_worker, 4, 11, REAL_CASES)
    _check_real_ranks(results, 11, REAL_CASES, 4)


@pytest.mark.integration
def test_every_policy_loss_on_two_gloo_ranks():
    """Every registered loss (each in one of the modes, prompt-mean included) on 2 real
    ranks with uneven micro-batches equals one process on the whole batch (one spawn)."""
    names = list_policy_losses()
    cases = [(name, MODES[k % len(MODES)]) for k, name in enumerate(names)]
    results = run_distributed(dp_policy_worker, 2, 12, cases)
    _check_real_ranks(results, 12, cases, 2)
