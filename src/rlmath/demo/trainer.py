"""What PPO and GRPO share: the models, the optimizer and LR schedule, one actor update.

A trainer step is: collect a rollout with the current policy, compute
log-probs of the sampled tokens under the policy (``old_log_prob``) and the
frozen reference model, turn rewards into advantages (the algorithm-specific
part), then run a few epochs of mini-batch updates on the clipped policy
loss. ``ppo.py`` and ``grpo.py`` fill in the middle.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod

import torch
from torch import nn

import rlmath
from rlmath.demo.batch import Rollout, response_forward
from rlmath.demo.config import DemoConfig
from rlmath.demo.metrics import check_finite
from rlmath.demo.model import DemoLM
from rlmath.demo.rollout import collect_rollout
from rlmath.demo.task import SortTask

__all__ = ["Trainer", "frozen_copy"]


def frozen_copy(model: DemoLM) -> DemoLM:
    """A deep copy with gradients off, in eval mode (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def minibatches(n: int, n_mini: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random split of ``range(n)`` into ``n_mini`` nearly equal index sets."""
    perm = torch.randperm(n, generator=generator)
    return [chunk for chunk in perm.chunk(max(1, min(n_mini, n))) if chunk.numel()]


class Trainer(ABC):
    """Holds the policy, its reference copy, the optimizer and the LR schedule."""

    #: responses sampled per prompt (1 for PPO).
    group_size: int = 1
    #: the loss terms of ``actor_loss``'s metrics checked for NaN/inf at every update.
    loss_metrics: tuple[str, ...] = ("pg_loss", "kl_loss")

    def __init__(
        self, cfg: DemoConfig, policy: DemoLM, task: SortTask, device: torch.device
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.ref = frozen_copy(policy)
        self.task = task
        self.device = device
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        # Linear warmup then cosine decay, a pure function of the step.
        self.scheduler = rlmath.get_cosine_schedule_with_warmup(
            self.optimizer,
            num_warmup_steps=cfg.lr_warmup_steps,
            num_training_steps=cfg.steps,
            min_lr_ratio=cfg.min_lr_ratio,
            # Step n (1-based) uses the multiplier at n, so the first update
            # does not run at lr 0.
            zero_indexed_step=False,
        )
        self.prompt_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + 3)

    def rollout(self, n_prompts: int) -> Rollout:
        return collect_rollout(
            self.policy,
            self.task,
            n_prompts=n_prompts,
            group_size=self.group_size,
            temperature=self.cfg.temperature,
            prompt_generator=self.prompt_gen,
            sample_generator=self.sample_gen,
            device=self.device,
        )

    @torch.no_grad()
    def score_rollout(self, batch: Rollout) -> dict[str, torch.Tensor]:
        """Fill ``old_log_prob`` and ``ref_log_prob``; return the rollout's KL and entropy.

        ``old_log_prob`` is recomputed by the training forward pass rather than
        taken from sampling, as verl does, so that the first PPO ratio is
        exactly 1 whatever numerical differences sampling has.
        """
        mask = batch.response_mask
        cur = response_forward(
            self.policy, batch, temperature=self.cfg.temperature, with_entropy=True
        )
        ref = response_forward(self.ref, batch, temperature=self.cfg.temperature)
        batch.old_log_prob, batch.ref_log_prob = cur.log_prob, ref.log_prob
        assert cur.entropy is not None
        # k3 is a non-negative, unbiased per-token estimate of KL(π‖π_ref).
        kl = rlmath.kl_penalty(cur.log_prob, ref.log_prob, "low_var_kl")
        stats = {
            "kl": rlmath.masked_mean(kl, mask),
            "entropy": rlmath.masked_mean(cur.entropy, mask),
        }
        for name, value in stats.items():
            check_finite(name, value)
        return stats

    def actor_loss(
        self, mb: Rollout, out_log_prob: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped policy loss minus the entropy bonus; GRPO adds its KL loss on top."""
        cfg = self.cfg
        assert mb.old_log_prob is not None and mb.advantages is not None
        policy_loss = rlmath.get_policy_loss("vanilla")
        pg_loss, pg_metrics = policy_loss(
            mb.old_log_prob,
            out_log_prob,
            mb.advantages,
            mb.response_mask,
            loss_agg_mode=cfg.loss_agg_mode,
            clip_ratio=cfg.clip_ratio,
            clip_ratio_high=cfg.clip_ratio_high,
        )
        entropy_loss = rlmath.agg_loss(entropy, mb.response_mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coef * entropy_loss
        return loss, {"pg_loss": pg_loss.detach(), **pg_metrics}

    def update_actor(self, batch: Rollout) -> dict[str, float]:
        """``ppo_epochs`` passes of ``mini_batches`` clipped-loss updates; mean metrics."""
        cfg = self.cfg
        self.policy.train()
        sums: dict[str, float] = {}
        n = 0
        for _ in range(cfg.ppo_epochs):
            for rows in minibatches(len(batch), cfg.mini_batches, self.shuffle_gen):
                mb = batch.select(rows.to(self.device))
                out = response_forward(
                    self.policy, mb, temperature=cfg.temperature, with_entropy=True
                )
                assert out.entropy is not None
                loss, metrics = self.actor_loss(mb, out.log_prob, out.entropy)
                # Stop at the first non-finite number, before it reaches the weights.
                for name in self.loss_metrics:
                    if name in metrics:
                        check_finite(name, metrics[name])
                check_finite("loss", loss)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                check_finite("grad_norm", grad_norm)
                self.optimizer.step()
                metrics["grad_norm"] = grad_norm
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        return {k: v / max(n, 1) for k, v in sums.items()}

    @abstractmethod
    def train_step(self) -> dict[str, float]:
        """One RL step; returns the step's metrics."""

    def step(self, step: int) -> dict[str, float]:
        """Run one step and time it; adds ``step``, ``lr`` and ``tokens_per_s``."""
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        metrics = self.train_step()
        self.scheduler.step()
        dt = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.pop("_tokens") / dt
        metrics["step_time_s"] = dt
        return {"step": step, "lr": lr, **metrics}

    def rollout_metrics(self, batch: Rollout) -> dict[str, float]:
        assert batch.scores is not None
        return {
            "reward_mean": float(batch.scores.mean()),
            "success_rate": float((batch.scores == 1.0).float().mean()),
            "response_length": float(batch.response_mask.sum(-1).float().mean()),
            # Valid prompt + response tokens processed this step (sampled, then
            # scored and trained on ppo_epochs times).
            "_tokens": float(batch.attention_mask.sum()),
        }
