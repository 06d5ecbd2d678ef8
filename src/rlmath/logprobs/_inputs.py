"""Argument checks and reshaping shared by the public log-prob / entropy / KL functions."""

from __future__ import annotations

import math

import torch

from rlmath._validation import check_tensor

__all__ = ["check_logits", "compute_dtype", "flatten_labels", "normalize_temperature"]


def check_logits(name: str, logits: object) -> torch.Tensor:
    """A floating tensor with at least one dim and a non-empty last (vocabulary) dim."""
    x = check_tensor(name, logits, floating=True)
    if x.dim() < 1:
        raise ValueError(f"{name} must have shape (..., V), got a 0-d tensor")
    if x.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a non-empty vocabulary dim V, got shape {tuple(x.shape)}"
        )
    return x


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def flatten_labels(
    labels: object, logits: torch.Tensor, *, validate: bool, name: str = "labels"
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``labels`` as an ``(N, K)`` int64 tensor plus the output shape.

    ``labels`` has shape ``logits.shape[:-1]`` (one label per row; output of the
    same shape) or ``logits.shape[:-1] + (K,)`` (K candidates per row; output
    ``(..., K)``).
    """
    lab = check_tensor(name, labels)
    if lab.is_floating_point() or lab.is_complex() or lab.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {lab.dtype}")
    if lab.device != logits.device:
        raise ValueError(f"{name} is on {lab.device} but logits is on {logits.device}")
    batch = tuple(logits.shape[:-1])
    if tuple(lab.shape) == batch:
        out_shape, k = batch, 1
    elif lab.dim() == logits.dim() and tuple(lab.shape[:-1]) == batch:
        out_shape, k = tuple(lab.shape), lab.shape[-1]
    else:
        raise ValueError(
            f"{name} must have shape logits.shape[:-1] = {batch} or {batch} + (K,), "
            f"got {tuple(lab.shape)}"
        )
    if validate and lab.numel():
        vocab = logits.shape[-1]
        lo, hi = int(lab.min()), int(lab.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} must lie in [0, {vocab}) (the vocabulary), found {bad}")
    return lab.reshape(math.prod(batch), k).long(), out_shape


def normalize_temperature(
    temperature: object,
    batch_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    validate: bool,
    shape_name: str = "logits.shape[:-1]",
    device_of: str = "logits",
) -> torch.Tensor | float | None:
    """``None`` for a temperature of exactly 1, a float, or a flat ``(N,)`` tensor.

    A tensor temperature must broadcast to ``batch_shape`` (called ``shape_name``
    in errors, ``logits.shape[:-1]`` by default; the tensor that sets the device
    is ``device_of``);
    it is treated as a constant (no gradient flows into it). Its positivity is
    checked only with ``validate`` (reading tensor data synchronizes).
    """
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"temperature must be a real tensor, got dtype {t.dtype}")
        if t.device != device:
            raise ValueError(f"temperature is on {t.device} but {device_of} is on {device}")
        try:
            t = t.to(dtype).expand(batch_shape)
        except RuntimeError:
            raise ValueError(
                f"temperature must be broadcastable to {shape_name} = {batch_shape}, "
                f"got shape {tuple(t.shape)}"
            ) from None
        t = t.reshape(-1)
        if validate and t.numel() and not bool(((t > 0) & torch.isfinite(t)).all()):
            raise ValueError("temperature must be finite and > 0 everywhere")
        return t
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"temperature must be a float or a tensor, got {type(temperature).__name__}"
        )
    t_val = float(temperature)
    if not math.isfinite(t_val) or t_val <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return None if t_val == 1.0 else t_val
