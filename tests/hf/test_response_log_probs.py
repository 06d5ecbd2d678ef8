"""``rlmath.hf.response_log_probs`` on tiny models: values and parameter gradients of the plain path."""

from __future__ import annotations

import pytest
import torch

from rlmath.fused_head import FusedLMHeadLogProbs
from rlmath.hf import head_of, response_log_probs
from tests.hf.models import MODELS, VOCAB, batch, model, reference, transformers
from tests.memory_tracker import MemoryTracker

R = 6


def _grads(m, loss):
    params = [p for p in m.parameters() if p.requires_grad]
    return dict(zip([n for n, p in m.named_parameters() if p.requires_grad],
                    torch.autograd.grad(loss, params, allow_unused=True)))  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, "tensor"])
def test_values_and_gradients_equal_the_plain_path(name, temperature):
    m = model(name)
    ids, mask = batch(response=R)
    t = (
        torch.tensor([0.6, 0.9, 1.3, 0.8], dtype=torch.float64)[:, None]
        if temperature == "tensor"
        else temperature
    )
    lp, ent = response_log_probs(m, ids, mask, R, temperature=t)
    rlp, rent = reference(
        m, ids, mask, R, temperature=t.expand(4, R) if isinstance(t, torch.Tensor) else t
    )
    assert lp.shape == ent.shape == (4, R) and lp.dtype == torch.float64
    torch.testing.assert_close(lp, rlp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, rent, rtol=1e-10, atol=1e-10)
    c = torch.randn(4, R, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = _grads(m, (lp * c).sum() + (ent * c.flip(0)).sum())
    want = _grads(m, (rlp * c).sum() + (rent * c.flip(0)).sum())
    for k in want:
        if want[k] is None:
            assert got[k] is None or (got[k] == 0).all(), k
            continue
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-10, msg=k)
    assert (lp[~mask[:, -R:].bool()] == 0).all()


def test_the_model_is_unchanged_after_the_call():
    m = model("gemma2")
    head = m.get_output_embeddings()
    ids, mask = batch(response=R)
    response_log_probs(m, ids, mask, R)
    assert "forward" not in head.__dict__
    assert m.config.final_logit_softcapping == 3.0
    assert m(input_ids=ids).logits.shape[-1] == VOCAB


def test_return_entropy_false_and_fp32_model():
    m = model("qwen2", dtype=torch.float32)
    ids, mask = batch(response=R)
    lp, ent = response_log_probs(m, ids, mask, R, return_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    rlp, _ = reference(m, ids, mask, R)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=2e-5)


def test_padded_vocabulary():
    m = model("llama")
    ids, mask = batch(response=R)
    ids = ids.clamp_max(49)
    lp, ent = response_log_probs(m, ids, mask, R, vocab_size=50)
    rlp, rent = reference(m, ids, mask, R, vocab=50)
    torch.testing.assert_close(lp, rlp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, rent, rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        response_log_probs(m, ids, mask, R, vocab_size=True)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        response_log_probs(m, ids, mask, R, vocab_size=VOCAB + 1)
    with pytest.raises(TypeError, match="ignore_vocab_padding is now called vocab_size"):
        response_log_probs(m, ids, mask, R, ignore_vocab_padding=50)


def test_no_logits_sized_tensor_is_created():
    V = 4096  # logits dominate: (B, S, V) is 256 times the hidden states
    m = model("qwen2", dtype=torch.float32, vocab=V)
    B, P = 8, 4
    ids, mask = batch(B=B, prompt=P, response=R)
    response_logits = B * R * V * 4  # bytes of the fp32 logits the response needs
    with MemoryTracker() as mem:
        lp, ent = response_log_probs(m, ids, mask, R, chunk_size=8, vocab_chunk_size=512)
        (lp.sum() + ent.sum()).backward()
    weight = V * 16 * 4  # the head's weight and its gradient are V x H
    big = [a for a in mem.allocations if a.nbytes > max(weight, response_logits // 8)]
    assert not big, big[:3]
    with MemoryTracker() as plain:
        m(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert any(a.nbytes >= B * (P + R) * V * 4 for a in plain.allocations)  # it sees logits


def test_bf16_autocast_equals_the_plain_path_under_autocast():
    m = model("llama", dtype=torch.float32)
    ids, mask = batch(response=R)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = response_log_probs(m, ids, mask, R)
        rlp, rent = reference(m, ids, mask, R)
    # The same bf16 logits reduced in fp32 on both sides (the reference upcasts them).
    torch.testing.assert_close(lp, rlp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, rent.float(), rtol=0, atol=1e-5)


def test_unknown_heads_and_bad_inputs_raise():
    m = model("llama")
    ids, mask = batch(response=R)

    class Odd(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Embedding(3, 3)

    with pytest.raises(TypeError, match="output embedding is Embedding, not an nn.Linear"):
        head_of(Odd())
    with pytest.raises(TypeError, match="get_output_embeddings"):
        head_of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="response_length"):
        response_log_probs(m, ids, mask, ids.shape[1])
    with pytest.raises(ValueError, match="attention_mask"):
        response_log_probs(m, ids, mask[:, 1:], R)
    with pytest.raises(ValueError, match="packed=True needs an attention implementation"):
        response_log_probs(m, ids, mask, R, packed=True)


@pytest.mark.parametrize("name", ["logits_to_keep", "position_ids", "use_cache", "labels"])
def test_model_kwargs_the_call_sets_itself_raise_one_line(name):
    m = model("llama")
    ids, mask = batch(response=R)
    with pytest.raises(TypeError, match=f"got {name}=") as info:
        response_log_probs(m, ids, mask, R, **{name: 3})
    message = str(info.value)
    # One line that names the argument, not the model's repr.
    assert "\n" not in message and "LlamaForCausalLM" not in message


def test_fused_module_on_a_hf_head():
    m = model("qwen2")
    ids, _ = batch(response=R)
    hidden = m.model(input_ids=ids).last_hidden_state
    fused = FusedLMHeadLogProbs(m.lm_head, temperature=0.9)
    lp, ent = fused(hidden[:, :-1], ids[:, 1:])
    ls = torch.log_softmax(m.lm_head(hidden[:, :-1]) / 0.9, -1)
    torch.testing.assert_close(lp, ls.gather(-1, ids[:, 1:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1))
    assert "forward" not in m.lm_head.__dict__


def test_transformers_is_imported():
    assert transformers.__version__


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_under_a_samplers_kept_set(name):
    import rlmath

    m = model(name)
    ids, mask = batch(response=R)
    kw = dict(top_k=20, top_p=0.8, min_p=0.01, sampler="vllm")
    lp, ent = response_log_probs(m, ids, mask, R, temperature=0.7, **kw)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -R - 1 : -1]
    valid = mask[:, -R:].bool()
    labels = torch.where(valid, ids[:, -R:], -100)
    want_lp, want_ent = rlmath.log_probs_and_entropy_from_logits(
        logits, labels, temperature=0.7, **kw
    )
    torch.testing.assert_close(lp[valid], want_lp[valid], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent[valid], want_ent[valid], rtol=1e-10, atol=1e-10)
    plain, _ = response_log_probs(m, ids, mask, R, temperature=0.7)
    assert torch.all(lp[valid] >= plain[valid] - 1e-12)  # renormalised over fewer tokens
    with pytest.raises(TypeError, match="top_p"):
        response_log_probs(m, ids, mask, R, top_p=torch.full((4, 1), 0.8))
