"""PPO with a critic, KL-shaped rewards, GAE, clipped policy and value losses.

Schulman et al. 2017 (https://arxiv.org/abs/1707.06347) as used for language
models by Ziegler et al. 2019 / Ouyang et al. 2022: the task reward sits on a
response's last token and every token pays ``β·KL`` to the reference model
(``rlmath.compute_rewards``), with β steered by
``rlmath.AdaptiveKLController``; a separate critic (the policy's trunk plus a
value head) estimates values, ``rlmath.compute_gae_advantage_return`` turns
rewards and values into whitened advantages and returns, and both networks
are updated with clipped losses (``rlmath.get_policy_loss("vanilla")``,
``rlmath.compute_value_loss``). With several processes the whitening of the
advantages, the KL the controller sees and every metric are over the whole
batch (``group=`` of the data-parallel ranks).
"""

from __future__ import annotations

import torch

import rlmath
from rlmath.demo.batch import ResponseModel, Rollout, response_forward
from rlmath.demo.config import DemoConfig
from rlmath.demo.metrics import check_finite
from rlmath.demo.model import DemoLM
from rlmath.demo.parallel import Layout
from rlmath.demo.rollout import token_level_scores
from rlmath.demo.task import SortTask
from rlmath.demo.trainer import Trainer, clip_grad_norm

__all__ = ["PPOTrainer"]


class PPOTrainer(Trainer):
    group_size = 1

    def __init__(
        self,
        cfg: DemoConfig,
        policy: DemoLM,
        task: SortTask,
        device: torch.device,
        layout: Layout | None = None,
    ) -> None:
        # The critic starts from the (warmed-up) policy's weights, as verl's
        # critic starts from the SFT model, with a fresh value head. Copied
        # before the policy is wrapped (FSDP2 shards the module in place).
        critic = _critic_from(policy)
        super().__init__(cfg, policy, task, device, layout)
        self.critic = self.layout.wrap(ResponseModel(critic), fsdp=cfg.fsdp)
        self.critic_optimizer = torch.optim.AdamW(
            self.critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0
        )
        self.critic_scheduler = rlmath.get_cosine_schedule_with_warmup(
            self.critic_optimizer,
            num_warmup_steps=cfg.lr_warmup_steps,
            num_training_steps=cfg.steps,
            min_lr_ratio=cfg.min_lr_ratio,
            # Step n (1-based) uses the multiplier at n, so the first update
            # does not run at lr 0.
            zero_indexed_step=False,
        )
        self.kl_ctrl = rlmath.AdaptiveKLController(
            init_kl_coef=cfg.kl_coef, target_kl=cfg.kl_target, horizon=cfg.kl_horizon
        )

    def update_critic(self, batch: Rollout) -> dict[str, float]:
        cfg = self.cfg
        assert batch.returns is not None and batch.values is not None
        self.critic.train()
        loss_sum, clip_sum, n = 0.0, 0.0, 0
        for _ in range(cfg.ppo_epochs):
            for mb in self.minibatches(batch):
                vpreds = response_forward(self.critic, mb, with_log_prob=False, with_values=True)
                assert vpreds.values is not None and mb.returns is not None
                assert mb.values is not None
                info = rlmath.global_batch_info(mb.response_mask, group=self.stats_group)
                vf_loss, vf_metrics = rlmath.compute_value_loss(
                    vpreds.values,
                    mb.returns,
                    mb.values,
                    mb.response_mask,
                    cliprange_value=cfg.cliprange_value,
                    loss_agg_mode=cfg.loss_agg_mode,
                    **info,
                )
                reduced = self.reduce_update_metrics(
                    {"loss": vf_loss, **vf_metrics}, mb.response_mask
                )
                check_finite("value_loss", reduced["loss"])
                self.critic_optimizer.zero_grad(set_to_none=True)
                vf_loss.backward()
                grad_norm = clip_grad_norm(self.critic, cfg.max_grad_norm, self.layout)
                check_finite("critic_grad_norm", grad_norm)
                self.critic_optimizer.step()
                loss_sum += reduced["loss"]
                clip_sum += reduced["vf_clipfrac"]
                n += 1
        return {"value_loss": loss_sum / n, "vf_clipfrac": clip_sum / n}

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        # 1. Rollout: one sampled response per prompt, scored by the task
        #    (this rank's share of the prompts).
        batch = self.rollout(cfg.batch_size, step)
        assert batch.scores is not None
        mask = batch.response_mask
        # 2. Log-probs under π_old and π_ref, values from the critic.
        stats = self.score_rollout(batch)
        assert batch.old_log_prob is not None and batch.ref_log_prob is not None
        with torch.no_grad():
            batch.values = response_forward(
                self.critic, batch, with_log_prob=False, with_values=True
            ).values
        assert batch.values is not None
        # 3. Rewards: outcome score on the last token, minus β·KL(k1) on every token.
        beta = self.kl_ctrl.value
        rewards = rlmath.compute_rewards(
            token_level_scores(batch.scores, mask, self.dtype),
            batch.old_log_prob,
            batch.ref_log_prob,
            beta,
            estimator="k1",
            response_mask=mask,
        )
        # The controller sees the same k1 KL that the rewards paid, per token,
        # over the whole batch.
        kl_k1 = self.mean(rlmath.kl_penalty(batch.old_log_prob, batch.ref_log_prob, "k1"), mask)
        self.kl_ctrl.update(check_finite("kl_k1", kl_k1), n_steps=cfg.batch_size)
        # 4. GAE: advantages (whitened over the valid tokens of every rank) and returns.
        batch.advantages, batch.returns = rlmath.compute_gae_advantage_return(
            rewards, batch.values, mask, gamma=cfg.gamma, lam=cfg.lam, group=self.stats_group
        )
        # 5. Critic and actor updates (the clipped losses).
        critic = self.update_critic(batch)
        self.critic_scheduler.step()
        update = self.update_actor(batch)
        return {
            **self.rollout_metrics(batch),
            **{name: float(value) for name, value in stats.items()},
            "clip_frac": update.get("pg_clipfrac", 0.0),
            **critic,
            "kl_coef": beta,
            "kl_k1": float(kl_k1),
            "values_mean": float(self.mean(batch.values, mask)),
            **{k: v for k, v in update.items() if k != "pg_clipfrac"},
        }


def _critic_from(policy: DemoLM) -> DemoLM:
    import copy

    critic = copy.deepcopy(policy)
    critic.add_value_head()
    # The critic's LM head is never used: frozen, it is left out of the
    # optimizer and of DDP's gradient reduction.
    critic.lm_head.requires_grad_(False)
    return critic
