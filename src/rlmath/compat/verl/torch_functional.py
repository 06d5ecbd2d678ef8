"""verl 0.9.1 ``verl.utils.torch_functional`` math helpers, computed by rlmath.

Each function has verl's exact signature (positional order, names, defaults)
and returns what verl returns, with rlmath's semantics (README "Where rlmath
deliberately differs"): results are fp32 for half-precision inputs (fp64 for
fp64), NaN/inf under a mask never reaches a result, an empty mask gives 0,
``masked_var`` with one valid element gives 0 instead of raising, masked
positions of ``masked_whiten`` are exactly 0, packed (rmpad) log-probs shift
labels within each sequence, and the cosine schedule holds its final value
past ``num_training_steps``.

Not provided (no math rlmath covers, or not math): ``gather_from_labels``
(one ``torch.gather``), ``logprobs_from_logits_flash_attn`` /
``logprobs_from_logits_torch_npu`` (device kernels; ``logprobs_from_logits``
covers their result), ``post_process_logits`` (divides the logits in place;
rlmath's functions take ``temperature=``), ``compute_grad_norm``,
``broadcast_dict_tensor``, ``allgather_dict_tensors``,
``allgather_dict_into_dict``, ``split_dict_tensor_into_batches``,
``postprocess_data``, ``tokenize_and_postprocess_data``, ``remove_pad_token``,
``prepare_decoder_attention_mask``, ``expand_as_nested``,
``check_device_is_available`` and ``use_original_torch_compile`` (tensor
plumbing, tokenisation, attention masks, device and compiler utilities).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

import rlmath
import rlmath.distributed as rd
from rlmath.compat.verl._state import world_group

__all__ = [
    "calculate_sum_pi_squared_from_logits",
    "clip_by_value",
    "distributed_masked_mean",
    "distributed_mean_max_min_std",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_response_mask",
    "get_unpad_data",
    "get_wsd_schedule_with_warmup",
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
    "logprobs_from_logits",
    "logprobs_from_logits_naive",
    "logprobs_from_logits_v2",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
]

#: The names ``install()`` replaces in ``verl.utils.torch_functional``.
VERL_NAMES: tuple[str, ...] = tuple(__all__)


# ------------------------------------------------------------------ masked statistics


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """``Σ mask·values`` (:func:`rlmath.masked_sum`); fp32 for half inputs."""
    return rlmath.masked_sum(values, mask, axis=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Any = None) -> torch.Tensor:
    """``Σ mask·values / Σ mask`` (:func:`rlmath.masked_mean`); 0 for an empty mask."""
    return rlmath.masked_mean(values, mask, axis=axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Two-pass masked variance (:func:`rlmath.masked_var`); ``n ≤ 1`` gives 0 (verl raises)."""
    return rlmath.masked_var(values, mask, unbiased=unbiased)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Masked whitening (:func:`rlmath.masked_whiten`); masked positions are exactly 0."""
    return rlmath.masked_whiten(values, mask, shift_mean=shift_mean)


def get_response_mask(
    response_id: torch.Tensor, eos_token: int | list[int] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Tokens up to and including the first EOS (:func:`rlmath.get_response_mask`)."""
    return rlmath.get_response_mask(response_id, eos_token, dtype)


def clip_by_value(
    x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor
) -> torch.Tensor:
    """``max(min(x, tensor_max), tensor_min)`` (:func:`rlmath.clip_by_value`)."""
    return rlmath.clip_by_value(x, tensor_min, tensor_max)


def pad_2d_list_to_length(
    response: Sequence[Sequence[float]], pad_token_id: float, max_length: int | None = None
) -> torch.Tensor:
    """Right-pad a list of rows into a 2-D tensor (:func:`rlmath.pad_2d_list_to_length`)."""
    return rlmath.pad_2d_list_to_length(response, pad_token_id, max_length)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: float, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dimension to ``max_seq_len`` (:func:`rlmath.pad_sequence_to_length`)."""
    return rlmath.pad_sequence_to_length(tensors, max_seq_len, pad_token_id, left_pad)


def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(indices, cu_seqlens, max_seqlen_in_batch)`` of a ``(B, S)`` attention mask.

    ``indices``: int64 flat positions of the valid tokens; ``cu_seqlens``:
    int32 ``(B + 1,)`` (:func:`rlmath.cu_seqlens`); ``max_seqlen_in_batch``: a
    Python int, as verl returns (reading it is a host sync, as in verl).
    """
    valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    cu = rlmath.cu_seqlens(attention_mask)
    seqlens = cu[1:] - cu[:-1]
    return indices, cu, int(seqlens.max().item()) if seqlens.numel() else 0


# ------------------------------------------------------------------ log-probs and entropy


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """Log-probs of ``labels`` (:func:`rlmath.log_probs_from_logits`), fp32, bounded memory.

    ``inplace_backward`` is accepted for verl's signature; rlmath's backward
    always writes into the gradient buffer without an ``[N, V]`` temporary.
    """
    del inplace_backward
    return rlmath.log_probs_from_logits(logits, labels, ignore_index=None)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``log_softmax`` + gather path; rlmath's chunked computation, fp32."""
    return rlmath.log_probs_from_logits(logits, labels, ignore_index=None)


def logprobs_from_logits_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's row-by-row path; rlmath's chunked computation, fp32 (verl: bf16 for bf16)."""
    return rlmath.log_probs_from_logits(logits, labels, ignore_index=None)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` (:func:`rlmath.entropy_from_logits`), fp32.

    Finite for ``-inf`` logits (verl: NaN); bounded memory.
    """
    return rlmath.entropy_from_logits(logits)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Entropy computed ``chunk_size`` rows at a time (:func:`rlmath.entropy_from_logits`).

    fp32 (fp64 for fp64 logits; verl: always fp32), and differentiable.
    """
    return rlmath.entropy_from_logits(logits, chunk_size=chunk_size)


def log_probs_from_logits_response(
    input_ids: torch.Tensor, logits: torch.Tensor, response_length: int
) -> torch.Tensor:
    """Response log-probs from full logits (:func:`rlmath.log_probs_from_logits_response`)."""
    return rlmath.log_probs_from_logits_response(input_ids, logits, response_length)


def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """Response log-probs from packed logits (:func:`rlmath.log_probs_from_logits_response_rmpad`).

    Labels are shifted within each sequence (verl's global ``torch.roll``
    scores each sequence's last token with the next sequence's first token),
    and flash-attn is not needed.
    """
    return rlmath.log_probs_from_logits_response_rmpad(
        input_ids, attention_mask, logits_rmpad, response_length
    )


def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
) -> torch.Tensor:
    """Response log-probs from packed ids and logits (:func:`rlmath.log_probs_from_logits_all_rmpad`)."""
    return rlmath.log_probs_from_logits_all_rmpad(
        input_ids_rmpad, logits_rmpad, indices, batch_size, seqlen, response_length
    )


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``Σ_v softmax(logits)_v²`` per row (:func:`rlmath.sum_pi_squared_from_logits`), fp32."""
    return rlmath.sum_pi_squared_from_logits(logits)


# ------------------------------------------------------------------ schedules


def get_cosine_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    init_lr_ratio: float | None = None,
    zero_indexed_step: bool = True,
) -> LambdaLR:
    """Warmup then cosine decay (:func:`rlmath.get_cosine_schedule_with_warmup`).

    Past ``num_training_steps`` the multiplier holds at ``min_lr_ratio``
    (verl's climbs back towards the peak).
    """
    return rlmath.get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles, last_epoch,
        init_lr_ratio, zero_indexed_step,
    )  # fmt: skip


def get_constant_schedule_with_warmup(
    optimizer: Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Warmup then constant (:func:`rlmath.get_constant_schedule_with_warmup`)."""
    return rlmath.get_constant_schedule_with_warmup(optimizer, num_warmup_steps, last_epoch)


def get_wsd_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    stable_ratio: float = 0.9,
) -> LambdaLR:
    """Warmup-stable-decay (:func:`rlmath.get_wsd_schedule_with_warmup`)."""
    return rlmath.get_wsd_schedule_with_warmup(
        optimizer, num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles, last_epoch,
        stable_ratio,
    )  # fmt: skip


# ------------------------------------------------------------------ distributed


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor,
    compute_max: bool = True,
    compute_min: bool = True,
    compute_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Global (mean, max, min, std) over the default process group.

    :func:`rlmath.distributed.distributed_mean_max_min_std`; outside
    ``torch.distributed`` it is the local statistics (verl requires a group).
    """
    return rd.distributed_mean_max_min_std(
        local_tensor, compute_max, compute_min, compute_std, group=world_group()
    )


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """Global masked mean over the default process group (:func:`rlmath.masked_mean` with ``group``)."""
    return rlmath.masked_mean(local_tensor, local_mask, group=world_group())
