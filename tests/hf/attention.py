"""Attention written from its definition, registered with ``transformers`` for the tests.

Gemma 2 soft-caps its attention scores, which ``transformers`` refuses to run
through SDPA, and its eager attention gives NaN on left-padded fp64 batches
(a fully masked padding row poisons the later layers). The test models that
need it use :func:`reference_attention` instead: scores, the optional
soft-cap, the mask, a softmax, and exact zeros for a query that sees no key.
:func:`varlen_attention` is the same within each packed sequence of
``cu_seq_lens_q`` (the keyword flash-attention's varlen path reads).
"""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="transformers is not installed (pip install '.[hf]')"
)
from transformers.masking_utils import sdpa_mask  # noqa: E402  (after the skip above)

REFERENCE = "reference_attention"
VARLEN = "varlen_attention"


def _attend(query, key, value, allowed, scaling, softcap):
    """``softmax(cap(q·kᵀ·scaling))·v`` over the allowed keys; 0 for a query with none.

    Shapes: ``query`` (b, h, q, d), ``key``/``value`` (b, h_kv, k, d), ``allowed``
    broadcastable to (b, h, q, k), bool.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = torch.where(allowed, scores, float("-inf"))
    sees_some = allowed.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(sees_some, scores, 0), dim=-1)
    probs = torch.where(allowed & sees_some, probs, 0)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def _causal(q_len: int, k_len: int, device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        softcap=None, **kwargs):  # fmt: skip
    q_len, k_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        allowed = _causal(q_len, k_len, query.device)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., :k_len]
    else:  # additive: 0 where allowed, a large negative number where not
        allowed = attention_mask[..., :k_len] == 0
    return _attend(query, key, value, allowed, scaling, softcap)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, **kwargs):  # fmt: skip
    cu = kwargs["cu_seq_lens_q"]
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3],
                      dtype=query.dtype, device=query.device)  # fmt: skip
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        allowed = _causal(b - a, b - a, query.device)
        out[:, a:b], _ = _attend(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], allowed, scaling, softcap
        )
    return out, None


transformers.AttentionInterface.register(REFERENCE, reference_attention)
# Without a registered mask function transformers passes no mask (padding ignored):
# take SDPA's boolean one (True = may attend; None when plain causal suffices).
transformers.AttentionMaskInterface.register(REFERENCE, sdpa_mask)
transformers.AttentionInterface.register(VARLEN, varlen_attention)
