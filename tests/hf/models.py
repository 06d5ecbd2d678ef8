"""Tiny ``transformers`` causal LMs built from configs (no downloads) and a plain reference."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="transformers is not installed (pip install '.[hf]')"
)

from tests.hf import attention  # noqa: E402  (after the skip above)

VOCAB, HIDDEN = 61, 16
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip


def config(name: str, **overrides):
    T = transformers
    common = {**_COMMON, **overrides}
    if name == "llama":  # untied head
        return T.LlamaConfig(**common, tie_word_embeddings=False)
    if name == "qwen2":  # tied head
        return T.Qwen2Config(**common, tie_word_embeddings=True)
    if name == "gemma2":  # soft-capped logits
        return T.Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0)
    if name == "cohere":  # scaled logits
        return T.CohereConfig(**common, logit_scale=0.5)
    if name == "granite":  # logits divided by logits_scaling
        return T.GraniteConfig(**common, logits_scaling=4.0, tie_word_embeddings=False)
    if name == "phi":  # a head with a bias
        kw = {k: v for k, v in common.items() if k != "num_key_value_heads"}
        return T.PhiConfig(**kw)
    raise KeyError(name)


MODELS = ["llama", "qwen2", "gemma2", "cohere", "granite", "phi"]


def model(name: str, dtype=torch.float64, seed: int = 0, vocab: int | None = None, **kwargs):
    torch.manual_seed(seed)
    cfg = config(name, **({"vocab_size": vocab} if vocab else {}))
    if name == "gemma2":  # soft-capped attention: transformers refuses SDPA for it
        kwargs.setdefault("attn_implementation", attention.REFERENCE)
    m = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs).to(dtype)
    with torch.no_grad():  # random weights of a visible size (some inits are ~0)
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def batch(B=4, prompt=5, response=6, seed=1):
    """verl's layout: left-padded prompts, right-padded responses (one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, prompt + response), generator=g)
    mask = torch.ones(B, prompt + response, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, : prompt - 1] = 0  # a one-token prompt
    mask[1, prompt + 3 :] = 0  # a short response
    mask[2, prompt + 1 :] = 0  # a response of length 1
    ids = torch.where(mask.bool(), ids, 2)
    return ids, mask


def reference(m, ids, mask, R, temperature=1.0, vocab=None):
    """``log_softmax(model(...).logits / T)`` at the response tokens (and the entropy)."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -R - 1 : -1]
    if vocab is not None:
        logits = logits[..., :vocab]
    t = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    ls = (
        torch.log_softmax(logits.float() / t, -1)
        if logits.dtype != torch.float64
        else torch.log_softmax(logits / t, -1)
    )
    valid = mask[:, -R:].bool()
    lp = ls.gather(-1, ids[:, -R:, None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return torch.where(valid, lp, 0), torch.where(valid, ent, 0)
