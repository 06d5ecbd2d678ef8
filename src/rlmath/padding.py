"""Remove and restore padding ("rmpad") without flash-attn.

Variable-length attention kernels take the valid tokens of a batch packed
into one ``(N, ...)`` tensor plus cumulative sequence lengths. These functions
build and undo that packing in pure torch and return exactly what
``flash_attn.bert_padding`` returns, so code written against flash-attn runs
unchanged:

* ``indices``: int64, shape ``(N,)``, the flat positions ``b * seqlen + t`` of
  the valid tokens in row-major order;
* ``cu_seqlens``: int32, shape ``(B + 1,)``, starting with 0;
* ``max_seqlen_in_batch``: a Python int;
* ``seqused``: int32, shape ``(B,)``, the number of valid tokens per row.

Any padding layout works (left, right, holes in the middle): the packing
follows the mask, never an assumed layout. Everything is differentiable with
respect to the data: gathering uses ``index_select`` (backward scatters into a
zero tensor of the input's size, nothing more) and scattering uses an
out-of-place ``index_copy`` (backward gathers). The data keeps its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlmath._validation import check_index_tensor, check_int, check_tensor, valid_mask

__all__ = ["cu_seqlens", "index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def _check_int(name: str, value: object) -> int:
    return check_int(name, value, 0)


def _check_indices(indices: object) -> torch.Tensor:
    indices = check_index_tensor("indices", indices)
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    return indices


def _check_attention_mask(name: str, mask: object) -> torch.Tensor:
    mask = check_tensor(name, mask)
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seqlen), got {tuple(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool, integer or floating, got dtype {mask.dtype}")
    return valid_mask(mask)


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``input[indices]`` of the first axis, differentiable w.r.t. ``input``.

    Args:
        input: Shape ``(M, ...)``, any dtype.
        indices: integer tensor, shape ``(N,)``, values in ``[0, M)``.

    Returns:
        Shape ``(N, ...)``, dtype of ``input``.
    """
    check_tensor("input", input)
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension, got a 0-d tensor")
    indices = _check_indices(indices)
    if indices.device != input.device:
        raise ValueError(f"indices is on {indices.device} but input is on {input.device}")
    return input.index_select(0, indices)


def index_put_first_axis(
    values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int
) -> torch.Tensor:
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at ``indices``.

    The inverse of :func:`index_first_axis` for unique indices; differentiable
    w.r.t. ``values``. Rows not named in ``indices`` are 0.

    Args:
        values: Shape ``(N, ...)``, any dtype.
        indices: integer tensor, shape ``(N,)``, unique values in ``[0, first_axis_dim)``.
        first_axis_dim: number of rows of the result.

    Returns:
        Shape ``(first_axis_dim, ...)``, dtype of ``values``.
    """
    check_tensor("values", values)
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension, got a 0-d tensor")
    indices = _check_indices(indices)
    first_axis_dim = _check_int("first_axis_dim", first_axis_dim)
    if indices.shape[0] != values.shape[0]:
        raise ValueError(
            f"indices must have one entry per row of values ({values.shape[0]}), "
            f"got {indices.shape[0]}"
        )
    if indices.device != values.device:
        raise ValueError(f"indices is on {indices.device} but values is on {values.device}")
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices.to(torch.int64), values)


def cu_seqlens(attention_mask_or_seqlens: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths with a leading 0, as varlen attention expects.

    Args:
        attention_mask_or_seqlens: either a mask of shape ``(B, T)`` (bool or
            numeric, nonzero = valid) or the lengths themselves, an integer
            tensor of shape ``(B,)``.

    Returns:
        int32, shape ``(B + 1,)``: ``[0, len_0, len_0 + len_1, ...]``. No host sync.
    """
    x = check_tensor("attention_mask_or_seqlens", attention_mask_or_seqlens)
    if x.dim() == 2:
        lengths = _check_attention_mask("attention_mask_or_seqlens", x).sum(-1, dtype=torch.int32)
    elif x.dim() == 1:
        lengths = check_index_tensor("attention_mask_or_seqlens of shape (B,)", x)
    else:
        raise ValueError(
            "attention_mask_or_seqlens must be a (B, T) mask or (B,) lengths, "
            f"got shape {tuple(x.shape)}"
        )
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the valid tokens of a padded batch into one tensor.

    A token is packed when ``attention_mask`` (or ``unused_mask``, flash-attn's
    "allocated but unused" slots) is nonzero there. Rows keep their order and
    tokens keep their order within a row, whatever the padding layout.

    Host syncs: like flash-attn's, this function synchronizes with the device
    (``torch.nonzero`` needs the number of valid tokens, and
    ``max_seqlen_in_batch`` is read back as a Python int). Call it once per
    batch and reuse the results.

    Args:
        hidden_states: Shape ``(B, T, ...)``, any dtype (token ids as ``(B, T)``
            work too).
        attention_mask: Shape ``(B, T)``, bool or numeric, nonzero = valid.
        unused_mask: None, or shape ``(B, T)``: slots packed too but not
            counted in ``seqused``.

    Returns:
        ``(packed, indices, cu_seqlens, max_seqlen_in_batch, seqused)``:
        ``packed`` ``(N, ...)`` in ``hidden_states``' dtype; ``indices`` int64
        ``(N,)`` flat positions ``b * T + t``; ``cu_seqlens`` int32 ``(B + 1,)``
        over attention + unused slots; ``max_seqlen_in_batch`` Python int (0 for
        an empty batch); ``seqused`` int32 ``(B,)`` counting ``attention_mask`` only.
    """
    check_tensor("hidden_states", hidden_states)
    valid = _check_attention_mask("attention_mask", attention_mask)
    if tuple(hidden_states.shape[:2]) != tuple(valid.shape):
        raise ValueError(
            "hidden_states must start with the attention_mask shape "
            f"{tuple(valid.shape)}, got {tuple(hidden_states.shape)}"
        )
    if valid.device != hidden_states.device:
        raise ValueError(
            f"attention_mask is on {valid.device} but hidden_states is on {hidden_states.device}"
        )
    seqused = valid.sum(-1, dtype=torch.int32)
    if unused_mask is not None:
        unused = _check_attention_mask("unused_mask", unused_mask)
        if unused.shape != valid.shape:
            raise ValueError(
                f"unused_mask must have the attention_mask shape {tuple(valid.shape)}, "
                f"got {tuple(unused.shape)}"
            )
        valid = valid | unused.to(valid.device)
    batch, seqlen = valid.shape
    seqlens = valid.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(valid.reshape(-1)).reshape(-1)
    max_seqlen = int(seqlens.max()) if batch > 0 else 0
    flat = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    packed = flat.index_select(0, indices)
    return packed, indices, cu_seqlens(seqlens), max_seqlen, seqused


def pad_input(
    hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """Scatter packed tokens back into a zero-padded ``(batch, seqlen, ...)`` tensor.

    The inverse of :func:`unpad_input`: ``pad_input(*unpad_input(x, m)[:2], B, T)``
    equals ``x`` where ``m`` is valid and 0 elsewhere. Differentiable w.r.t.
    ``hidden_states``.

    Args:
        hidden_states: packed tokens, shape ``(N, ...)``, any dtype.
        indices: integer tensor ``(N,)`` of flat positions ``b * seqlen + t``
            (the ``indices`` returned by :func:`unpad_input`).
        batch, seqlen: the padded shape.

    Returns:
        Shape ``(batch, seqlen, ...)``, dtype of ``hidden_states``.
    """
    batch = _check_int("batch", batch)
    seqlen = _check_int("seqlen", seqlen)
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
