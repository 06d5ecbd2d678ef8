"""The demo's settings: one dataclass, filled from the command line.

This is application code, so a config object is fine here; the rlmath
functions it drives take plain keyword scalars.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

__all__ = ["ALGOS", "ALGO_DEFAULTS", "DTYPES", "DemoConfig", "Truncation"]

ALGOS = ("ppo", "grpo")
DTYPES = ("float32", "float64")


class Truncation(TypedDict, total=False):
    """A truncating sampler's arguments, as rlmath's log-probs functions take them."""

    top_k: int
    top_p: float
    min_p: float


@dataclass
class DemoConfig:
    """Everything a demo run depends on.

    The field defaults are GRPO's; :meth:`for_algo` applies the per-algorithm
    defaults (:data:`ALGO_DEFAULTS`) before the caller's overrides.
    """

    algo: str = "grpo"
    steps: int = 200
    batch_size: int = 16  # prompts per step
    group_size: int = 8  # GRPO: responses sampled per prompt
    lr: float = 5e-4
    kl_coef: float = 0.01  # PPO: initial β of the adaptive controller; GRPO: KL loss coef
    seed: int = 0
    device: str = "cpu"
    out: Path | None = None  # None: a fresh folder runs/demo-<algo>-<timestamp> per run
    overwrite: bool = False  # replace the outputs of a previous run in ``out``
    model: str = "tiny"
    threads: int | None = None  # None: 1
    progress: bool = True
    #: Parameters and every computation: "float32", or "float64" (for exact comparisons).
    dtype: str = "float32"

    # Parallelism (see rlmath.demo.parallel): the processes themselves are
    # started by torchrun or `rlmath demo --nproc N`.
    fsdp: bool = False  # FSDP2 fully_shard instead of DDP
    tp: int = 1  # tensor-parallel (vocabulary-parallel LM head) ranks per data-parallel rank

    # Task: sort strings of min_len..max_len distinct digits.
    min_len: int = 3
    max_len: int = 5

    # Model size.
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4

    # Supervised warm-up on the answer *format* only (see rlmath.demo.warmup).
    warmup_steps: int = 100
    warmup_examples: int = 256

    # RL hyper-parameters shared by both algorithms.
    temperature: float = 1.0
    # A truncating sampler (vLLM's rule); the trainer's log-probs use the same kept set.
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    ppo_epochs: int = 2
    mini_batches: int = 2
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None  # DAPO's "clip-higher" when above clip_ratio
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    lr_warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0

    # PPO only.
    gamma: float = 1.0
    lam: float = 0.95
    critic_lr: float = 2e-3
    cliprange_value: float = 0.2
    kl_target: float = 0.05
    kl_horizon: int = 10_000

    @property
    def truncation(self) -> Truncation:
        """The sampler's ``top_k`` / ``top_p`` / ``min_p`` that are set, as keyword arguments."""
        out = Truncation()
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.min_p is not None:
            out["min_p"] = self.min_p
        return out

    @classmethod
    def for_algo(cls, algo: str, **overrides: object) -> DemoConfig:
        """The config of ``algo`` with its defaults, then ``overrides`` (None = keep default)."""
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(algo=algo, **{**ALGO_DEFAULTS[algo], **given})  # type: ignore[arg-type]


# Per-algorithm defaults, tuned so that each run finishes in a few minutes on
# two CPU cores (see docs/demo.md for the measured figures). PPO samples one
# response per prompt, so it takes more prompts per step.
ALGO_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": {"batch_size": 64},
    "grpo": {"batch_size": 16},
}
