"""Per-token response log-probs and entropy straight from a causal LM, never holding ``[N, V]`` logits.

The model runs as usual (``model(...)``, so every hook a trainer installed —
FSDP2's parameter gathering, activation checkpointing, mixed precision —
runs too), except that its output embedding (the LM head) is swapped for the
duration of the call: instead of the logits it computes, with the fused head
of :mod:`rlmath.fused_head`, the log-prob and entropy of each response token,
and hands them back as the model's ``logits`` output (a ``(B, R, 2)`` tensor),
so the gradient path runs through the model's own outputs. Logit
post-processing the model would apply after its head (Gemma's soft-capping,
Cohere's and Granite's scaling) is done inside the fused head instead and
switched off in the config for the call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlmath._validation import check_index_tensor, check_temperature, check_tensor
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.fused_head.through_module import swapped_forward

__all__ = ["PACKED_ATTENTION", "HeadSpec", "head_of", "response_log_probs"]

IGNORE = -100

PACKED_ATTENTION = {"flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"}
"""Attention implementations that run packed sequences (several sequences in one row,
told apart by ``position_ids`` and ``cu_seq_lens_q/k``) without attending across them;
add the name of another such implementation (one registered with
``transformers.AttentionInterface``) to let ``packed=None`` choose it."""


@dataclass(frozen=True)
class HeadSpec:
    """How a model turns its last hidden states into logits.

    Attributes:
        module: the output embedding (``nn.Linear``; tied or not).
        logit_scale: factor applied to the head's output (Cohere: ``logit_scale``;
            Granite: ``1 / logits_scaling``).
        softcap: Gemma 2/3's ``final_logit_softcapping``, or ``None``.
        config_overrides: config attributes to neutralize during a call, because
            the fused head applies them itself.
    """

    module: nn.Linear
    logit_scale: float
    softcap: float | None
    config_overrides: tuple[tuple[Any, str, Any], ...]


def head_of(model: Any) -> HeadSpec:
    """The :class:`HeadSpec` of a ``transformers`` causal LM.

    Raises:
        TypeError: the model has no ``get_output_embeddings()``, or its output
            embedding is not an ``nn.Linear`` (the error names what was found).
    """
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None:
        raise TypeError(
            f"model must be a transformers causal LM with get_output_embeddings(), got "
            f"{type(model).__name__}"
        )
    head = getter()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{type(model).__name__}'s output embedding is {type(head).__name__}, not an "
            "nn.Linear: rlmath.hf supports linear LM heads (tied or untied, with or without bias)"
        )
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # Where a model's forward reads each post-processing constant: its config, or an
    # attribute the model copied at construction (Cohere's self.logit_scale).
    owners = list({id(o): o for o in (model, cfg, text_cfg)}.values())
    overrides: list[tuple[Any, str, Any]] = []
    found: dict[str, float] = {}
    for name, neutral in (
        ("final_logit_softcapping", None),
        ("logit_scale", 1.0),
        ("logits_scaling", 1.0),
    ):
        for owner in owners:
            value = owner.__dict__.get(name, None) if owner is model else getattr(owner, name, None)
            if value is None or value == neutral or isinstance(value, (torch.Tensor, nn.Module)):
                continue
            found.setdefault(name, float(value))
            overrides.append((owner, name, neutral))
    softcap = found.get("final_logit_softcapping")
    scale = found.get("logit_scale", 1.0) / found.get("logits_scaling", 1.0)
    return HeadSpec(head, scale, softcap, tuple(overrides))


@contextlib.contextmanager
def _swapped(spec: HeadSpec, forward: Any) -> Iterator[None]:
    """``spec.module`` runs ``forward`` and the config's logit post-processing is off."""
    saved = [(c, name, getattr(c, name)) for c, name, _ in spec.config_overrides]
    with swapped_forward(spec.module, forward):
        try:
            for c, name, value in spec.config_overrides:
                setattr(c, name, value)
            yield
        finally:
            for c, name, value in saved:
                setattr(c, name, value)


def _vocab_limit(spec: HeadSpec, vocab_size: object) -> int | None:
    rows = spec.module.out_features
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(
            f"vocab_size must be an int (the number of real tokens) or None, got "
            f"{type(vocab_size).__name__}"
        )
    if not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size must be in [1, {rows}] (the head's rows), got {vocab_size}")
    return vocab_size


def _check_batch(
    input_ids: object, attention_mask: object, response_length: object
) -> tuple[torch.Tensor, torch.Tensor, int]:
    ids = check_index_tensor("input_ids", input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, S), got {tuple(ids.shape)}")
    mask = check_tensor("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(ids.shape) or mask.device != ids.device:
        raise ValueError(
            f"attention_mask must have the shape and device of input_ids {tuple(ids.shape)} "
            f"({ids.device}), got {tuple(mask.shape)} ({mask.device})"
        )
    S = ids.shape[1]
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    if not 1 <= response_length <= S - 1:
        raise ValueError(
            f"response_length must be in [1, {S - 1}] for sequences of {S} columns, "
            f"got {response_length}"
        )
    return ids, mask, response_length


#: Keyword arguments of ``model(...)`` that :func:`response_log_probs` sets itself,
#: with the reason a caller cannot pass them.
_RESERVED_MODEL_KWARGS = {
    "input_ids": "it is the second argument",
    "attention_mask": "it is the third argument",
    "position_ids": "positions are computed from attention_mask (cumsum - 1)",
    "use_cache": "the call runs without a KV cache",
    "logits_to_keep": "the call keeps the R + 1 positions that predict the response itself",
    "labels": "the labels are the response tokens of input_ids",
    "cu_seq_lens_q": "the packed layout is computed from attention_mask",
    "cu_seq_lens_k": "the packed layout is computed from attention_mask",
    "max_length_q": "the packed layout is computed from attention_mask",
    "max_length_k": "the packed layout is computed from attention_mask",
}

#: Arguments of earlier releases and their names now.
_RENAMED = {"ignore_vocab_padding": "vocab_size (the number of real tokens, an int)"}


def _check_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    for name, new in _RENAMED.items():
        if name in model_kwargs:
            raise TypeError(f"response_log_probs(): {name} is now called {new}")
    for name, why in _RESERVED_MODEL_KWARGS.items():
        if name in model_kwargs:
            raise TypeError(
                f"response_log_probs() got {name}=...: it sets {name} itself ({why}); "
                "remove it from the call"
            )


def response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = True,
    packed: bool | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    sampler: str = "vllm",
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy of each response token under a ``transformers`` causal LM.

    The batch is in verl's layout: ``input_ids = [left-padded prompt |
    right-padded response]``, ``attention_mask`` 1 on real tokens, the response
    in the last ``response_length`` columns. Positions are computed from the
    mask (``cumsum - 1``). The result equals
    ``log_softmax(model(...).logits / T)`` at the response tokens (and its
    entropy) in values and gradients, but the ``[B, S, V]`` logits never
    exist: the model's hidden states at the positions that predict the
    response go through the fused LM head (:mod:`rlmath.fused_head`).

    Supported heads: an ``nn.Linear`` output embedding (tied or untied, with
    or without bias), with Gemma 2/3's ``final_logit_softcapping``, Cohere's
    ``logit_scale`` and Granite's ``logits_scaling`` applied inside the fused
    head. Under FSDP2 (``fully_shard`` on the model, its head, or both) the
    call runs through the wrapped modules' own forward, so their parameters
    are gathered as for ``model(...)``; gradients equal the unwrapped model's.

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``).
        input_ids: ``(B, S)`` token ids.
        attention_mask: ``(B, S)`` bool or 0/1, 1 on real tokens.
        response_length: ``R``, the response columns at the end, in ``[1, S - 1]``.
        temperature: float > 0, or a tensor broadcastable to ``(B, R)`` (the
            temperature of each response token's prediction); no gradient.
        return_entropy: also return the entropy of each position's distribution.
        packed: run the model without padding (the valid tokens of all sequences
            in one row, told apart by ``position_ids``), which only an attention
            implementation that honours packed sequences can do
            (flash-attention). ``None``: packed exactly when the model's
            attention implementation is one of those; ``True`` there or an error.
        vocab_size: the number of real tokens (the tokenizer's vocabulary, e.g.
            ``len(tokenizer)``): head rows from it on are padding, left out of the
            softmax. ``None``: every row of the head is a token.
        chunk_size, vocab_chunk_size, backend: as in
            :func:`rlmath.fused_head.log_probs_and_entropy_from_hidden`.
        top_k, top_p, min_p, sampler: the log-probs and entropy under the kept
            set of the sampler that drew the responses, renormalised
            (``docs/sampling.md``): numbers, the same for every sequence (a
            per-sequence tensor is a ``TypeError``: pass the logits to
            :func:`rlmath.log_probs_from_logits_response` for those).
        **model_kwargs: passed on to ``model(...)``; those the call sets itself
            (``position_ids``, ``use_cache``, ``logits_to_keep``, ``labels``, the
            packed layout's ``cu_seq_lens_*`` / ``max_length_*``) raise a ``TypeError``.

    Returns:
        ``(log_probs, entropy)``, each ``(B, R)`` fp32 (fp64 for an fp64
        model), 0 at response padding (``attention_mask`` 0); ``entropy`` is
        ``None`` unless ``return_entropy``.
    """
    ids, mask, R = _check_batch(input_ids, attention_mask, response_length)
    _check_model_kwargs(model_kwargs)
    spec = head_of(model)
    B, S = ids.shape
    temp, scalar = check_temperature(
        temperature, (B, R), ids.device, validate=False, shape_name="(B, response_length)",
        device_of="input_ids",
    )  # fmt: skip
    vocab = _vocab_limit(spec, vocab_size)
    attn = getattr(model.config, "_attn_implementation", None)
    if packed is None:
        packed = attn in PACKED_ATTENTION
    elif packed and attn not in PACKED_ATTENTION:
        raise ValueError(
            f"packed=True needs an attention implementation that separates packed sequences "
            f"({', '.join(sorted(PACKED_ATTENTION))}); this model uses {attn!r}. Use "
            "packed=False (or add the implementation to rlmath.hf.PACKED_ATTENTION)."
        )
    valid = mask != 0
    labels = torch.where(valid[:, -R:], ids[:, -R:], IGNORE)
    t = temp if temp is not None else scalar
    head_kw = {
        "temperature": t, "return_entropy": return_entropy, "ignore_index": IGNORE,
        "chunk_size": chunk_size, "vocab_chunk_size": vocab_chunk_size, "backend": backend,
        "logit_scale": spec.logit_scale, "softcap": spec.softcap, "vocab_size": vocab,
    }  # fmt: skip
    truncation = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name, value in truncation.items():
        if isinstance(value, torch.Tensor):
            raise TypeError(
                f"rlmath.hf.response_log_probs takes {name} as a number (one for every "
                "sequence), got a tensor; per-sequence values: compute the logits and call "
                "rlmath.log_probs_from_logits_response"
            )
    if any(v is not None for v in truncation.values()) or sampler != "vllm":
        head_kw.update(truncation, sampler=sampler)
    if packed:
        return _packed(model, spec, ids, valid, labels, R, head_kw, model_kwargs)
    return _padded(model, spec, ids, mask, labels, R, head_kw, model_kwargs)


def _fused_forward(labels: torch.Tensor, rows: Any, head_kw: dict[str, Any]) -> Any:
    """The head's forward for one call: hidden states in, ``(…, 2)`` log-prob and entropy out."""

    def forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        h = rows(hidden)
        lp, ent = log_probs_and_entropy_from_hidden(
            h, head.weight, labels, bias=head.bias, **head_kw
        )
        return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], -1)

    return forward


def _logits_kwargs(model: nn.Module, keep: int) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": keep}
    return {}


def _padded(
    model: nn.Module,
    spec: HeadSpec,
    ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    R: int,
    head_kw: dict[str, Any],
    model_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
    # The head sees the last R + 1 positions when the model can slice them (else all
    # S); the first R of those predict the response tokens.
    extra = _logits_kwargs(model, R + 1)
    forward = _fused_forward(labels, lambda h: h[:, -R - 1 : -1], head_kw)
    with _swapped(spec, forward):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
            **extra, **model_kwargs,
        )  # fmt: skip
    packed_out = out.logits if hasattr(out, "logits") else out[0]
    lp, ent = packed_out[..., 0], packed_out[..., 1]
    return lp, ent if head_kw["return_entropy"] else None


def _packed(
    model: nn.Module,
    spec: HeadSpec,
    ids: torch.Tensor,
    valid: torch.Tensor,
    labels: torch.Tensor,
    R: int,
    head_kw: dict[str, Any],
    model_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Imported here: the packed layout helpers live with the engine.
    from rlmath.engine.packed import packed_row_of, response_rows

    B, S = ids.shape
    flat = valid.reshape(-1)
    index = torch.nonzero(flat).squeeze(1)  # the packed layout has a data-dependent length
    ids_p = ids.reshape(-1)[index].unsqueeze(0)
    lengths = valid.sum(-1)
    position_ids = ((valid.long().cumsum(-1) - 1).reshape(-1)[index]).unsqueeze(0)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    max_len = int(lengths.max()) if B else 0
    plan = response_rows(ids, packed_row_of(valid), R)
    rows, select = plan.rows, plan.select
    flat_labels = torch.where(select, labels, IGNORE).reshape(-1)
    forward = _fused_forward(flat_labels, lambda h: h[0][rows], head_kw)
    varlen = {
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len,
        "max_length_k": max_len,
    }  # fmt: skip
    with _swapped(spec, forward):
        out = model(
            input_ids=ids_p, position_ids=position_ids, use_cache=False, **varlen,
            **model_kwargs,
        )  # fmt: skip
    res = (out.logits if hasattr(out, "logits") else out[0]).reshape(B, R, 2)
    lp, ent = res[..., 0], res[..., 1]
    return lp, ent if head_kw["return_entropy"] else None
