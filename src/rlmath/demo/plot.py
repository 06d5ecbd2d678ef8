"""``curves.png``: reward, success rate and KL against the training step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlmath.demo.metrics import Record

__all__ = ["plot_curves"]


def plot_curves(records: Sequence[Record], path: Path, *, title: str = "") -> None:
    """Write a two-panel figure to ``path``: reward/success (top), KL (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]

    def series(key: str) -> list[float]:
        return [float("nan") if (v := r.get(key)) is None else v for r in records]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, series("reward_mean"), label="reward (mean)")
    ax1.plot(steps, series("success_rate"), label="success rate")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel("reward / success")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    ax2.plot(steps, series("kl"), color="tab:red", label="KL(π‖π_ref) per token")
    ax2.set_ylabel("KL")
    ax2.set_xlabel("RL step")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
