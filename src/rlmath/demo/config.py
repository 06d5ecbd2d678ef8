"""The demo's settings: one dataclass, filled from the command line.

This is application code, so a config object is fine here; the rlmath
functions it drives take plain keyword scalars.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALGOS", "DemoConfig"]

ALGOS = ("ppo", "grpo")


@dataclass
class DemoConfig:
    """Everything a demo run depends on. ``None`` means "the algorithm's default"."""

    algo: str = "grpo"
    steps: int | None = None
    batch_size: int | None = None  # prompts per step
    group_size: int = 8  # GRPO: responses sampled per prompt
    lr: float | None = None
    kl_coef: float | None = None  # PPO: initial β of the adaptive controller; GRPO: KL loss coef
    seed: int = 0
    device: str = "cpu"
    out: Path | None = None
    model: str = "tiny"
    threads: int | None = None
    progress: bool = True

    # Task: sort strings of min_len..max_len digits.
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
    ppo_epochs: int = 2
    mini_batches: int = 2
    clip_ratio: float = 0.2
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    lr_warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0

    # PPO only.
    gamma: float = 1.0
    lam: float = 0.95
    critic_lr: float | None = None
    cliprange_value: float = 0.2
    kl_target: float = 0.05
    kl_horizon: int = 10_000

    def resolved(self) -> DemoConfig:
        """A copy with every ``None`` replaced by the algorithm's default."""
        defaults = _DEFAULTS[self.algo]
        out = DemoConfig(**{**self.__dict__})
        for name, value in defaults.items():
            if getattr(out, name) is None:
                setattr(out, name, value)
        if out.out is None:
            out.out = Path("runs") / f"demo-{self.algo}"
        return out


# Per-algorithm defaults, tuned so that each run finishes in a few minutes on
# two CPU cores (see docs/demo.md for the measured figures).
_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": {"steps": 200, "batch_size": 64, "lr": 1e-3, "kl_coef": 0.01, "critic_lr": 2e-3},
    "grpo": {"steps": 200, "batch_size": 16, "lr": 1e-3, "kl_coef": 0.01, "critic_lr": 0.0},
}
