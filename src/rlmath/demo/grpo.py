"""GRPO: group sampling, group-normalized advantages, k3 KL loss to the reference.

Shao et al. 2024, "DeepSeekMath" (https://arxiv.org/abs/2402.03300), §4.1.
No critic: each prompt gets ``group_size`` responses, and a response's
advantage is its reward standardized within its group
(``rlmath.get_advantage_estimator("grpo")``), broadcast over its tokens. With
several processes a group never straddles two ranks (prompts are shared
out whole), so the group statistics each rank computes are the whole group's.
The KL to the reference model is a loss term (k3 estimator,
``rlmath.kl_penalty(..., "low_var_kl")`` aggregated by ``rlmath.agg_loss``),
not a reward penalty.
"""

from __future__ import annotations

import torch

import rlmath
from rlmath.demo.batch import Rollout
from rlmath.demo.config import DemoConfig
from rlmath.demo.model import DemoLM
from rlmath.demo.parallel import Layout
from rlmath.demo.rollout import token_level_scores
from rlmath.demo.task import SortTask
from rlmath.demo.trainer import Trainer
from rlmath.losses.aggregation import Aggregation

__all__ = ["GRPOTrainer"]


class GRPOTrainer(Trainer):
    def __init__(
        self,
        cfg: DemoConfig,
        policy: DemoLM,
        task: SortTask,
        device: torch.device,
        layout: Layout | None = None,
    ) -> None:
        self.group_size = cfg.group_size
        super().__init__(cfg, policy, task, device, layout)

    def actor_loss(
        self,
        mb: Rollout,
        out_log_prob: torch.Tensor,
        entropy: torch.Tensor,
        info: Aggregation,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = super().actor_loss(mb, out_log_prob, entropy, info)
        assert mb.ref_log_prob is not None
        kl = rlmath.kl_penalty(out_log_prob, mb.ref_log_prob, "low_var_kl")
        kl_loss = rlmath.agg_loss(
            kl, mb.response_mask, loss_agg_mode=self.cfg.loss_agg_mode, **info
        )
        metrics["kl_loss"] = kl_loss.detach()
        return loss + self.cfg.kl_coef * kl_loss, metrics

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        # 1. Rollout: batch_size prompts × group_size sampled responses, scored
        #    (this rank's share of the prompts).
        batch = self.rollout(cfg.batch_size, step)
        assert batch.scores is not None
        # 2. Log-probs of the sampled tokens under π_old (= current π) and π_ref.
        stats = self.score_rollout(batch)
        # 3. Advantages: the outcome reward sits on the last response token;
        #    GRPO standardizes the sequence score within each prompt's group.
        rewards = token_level_scores(batch.scores, batch.response_mask, self.dtype)
        grpo = rlmath.get_advantage_estimator("grpo")
        batch.advantages, batch.returns = grpo(rewards, batch.response_mask, batch.index)
        # 4. Policy update: clipped surrogate + β·KL(k3) − entropy bonus.
        update = self.update_actor(batch)
        return {
            **self.rollout_metrics(batch),
            **{name: float(value) for name, value in stats.items()},
            "clip_frac": update.get("pg_clipfrac", 0.0),
            "value_loss": float("nan"),
            **{k: v for k, v in update.items() if k != "pg_clipfrac"},
        }
