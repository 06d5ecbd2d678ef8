"""What PPO and GRPO share: the models, the optimizer and LR schedule, one actor update.

A trainer step is: collect a rollout with the current policy, compute
log-probs of the sampled tokens under the policy (``old_log_prob``) and the
frozen reference model, turn rewards into advantages (the algorithm-specific
part), then run a few epochs of mini-batch updates on the clipped policy
loss. ``ppo.py`` and ``grpo.py`` fill in the middle.

**Data parallelism.** With several processes each rank holds its share of
the step's prompts (:mod:`rlmath.demo.parallel`). Every statistic that the
one-process run takes over the batch is taken over all ranks
(``rlmath.distributed``), and each mini-batch is the one the one-process run
would draw: every rank draws the same permutation of the global rows and
trains on the rows of it that it holds. The losses divide by the mini-batch's
global token (or sequence) count and multiply by the number of data-parallel
ranks (``rlmath.global_batch_info``), so DDP's gradient average (or FSDP2's
reduce-scatter) is exactly the gradient of the whole mini-batch.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import rlmath
from rlmath.demo.batch import ResponseModel, Rollout, response_forward
from rlmath.demo.config import DemoConfig
from rlmath.demo.metrics import check_finite
from rlmath.demo.model import DemoLM
from rlmath.demo.parallel import Layout, full_tensor, prompt_shard
from rlmath.demo.rollout import collect_rollout
from rlmath.demo.task import SortTask
from rlmath.demo.vocab_parallel_head import VocabParallelLMHead
from rlmath.losses.aggregation import Aggregation

__all__ = ["Trainer", "clip_grad_norm", "frozen_copy", "local_minibatches", "minibatches"]

#: Update metrics that are (shares of) losses: their global value is the sum
#: over ranks divided by the number of data-parallel ranks. Every other update
#: metric is a mean over the mini-batch's valid tokens.
LOSS_METRICS = ("loss", "pg_loss", "kl_loss")


def frozen_copy(model: DemoLM) -> DemoLM:
    """A deep copy with gradients off, in eval mode (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def clip_grad_norm(module: nn.Module, max_norm: float, layout: Layout) -> float:
    """Clip the gradients of ``module`` to a total norm of ``max_norm``; return the norm before.

    The norm is that of the whole model's gradient, as in one process: under
    FSDP2 over every shard, and with a vocabulary-parallel head over every
    rank's slice of it (the replicated parameters count once).
    """
    if layout.tp == 1:
        return float(full_tensor(nn.utils.clip_grad_norm_(module.parameters(), max_norm)))
    sliced = {
        id(p)
        for m in module.modules()
        if isinstance(m, VocabParallelLMHead)
        for p in m.parameters()
    }
    params = [p for p in module.parameters() if p.grad is not None]
    replicated = [p.grad for p in params if p.grad is not None and id(p) not in sliced]
    local = [p.grad for p in params if p.grad is not None and id(p) in sliced]
    sq_local = full_tensor(nn.utils.get_total_norm(local)).to(torch.float64).square()
    dist.all_reduce(sq_local, op=dist.ReduceOp.SUM, group=layout.tp_group)
    sq = full_tensor(nn.utils.get_total_norm(replicated)).to(torch.float64).square() + sq_local
    total = sq.sqrt()
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def minibatches(n: int, n_mini: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random split of ``range(n)`` into ``n_mini`` nearly equal index sets."""
    perm = torch.randperm(n, generator=generator)
    return [chunk for chunk in perm.chunk(max(1, min(n_mini, n))) if chunk.numel()]


def local_minibatches(
    n_global: int, start: int, stop: int, n_mini: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """:func:`minibatches` of the global rows, each restricted to this rank's rows ``[start, stop)``.

    Returns local row indices (``global − start``); a mini-batch may hold
    none of this rank's rows (an empty tensor): the rank still takes part.
    """
    return [c[(c >= start) & (c < stop)] - start for c in minibatches(n_global, n_mini, generator)]


class Trainer(ABC):
    """Holds the policy, its reference copy, the optimizer and the LR schedule."""

    #: responses sampled per prompt (1 for PPO).
    group_size: int = 1
    #: the loss terms of ``actor_loss``'s metrics checked for NaN/inf at every update.
    loss_metrics: tuple[str, ...] = ("pg_loss", "kl_loss")

    def __init__(
        self,
        cfg: DemoConfig,
        policy: DemoLM,
        task: SortTask,
        device: torch.device,
        layout: Layout | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = layout = layout or Layout()
        self.ref = ResponseModel(frozen_copy(policy))
        # The module every call goes through (DDP or FSDP2 act on its forward).
        self.actor = layout.wrap(ResponseModel(policy), fsdp=cfg.fsdp)
        self.task = task
        self.device = device
        self.dtype = torch.promote_types(next(policy.parameters()).dtype, torch.float32)
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=cfg.lr, weight_decay=0.0)
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
        # The same on every rank: every rank draws the global prompts and
        # mini-batch permutations, and keeps its share.
        self.prompt_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 2)
        #: Rows of the global batch this rank holds: ``[row_start, row_stop)``.
        first, stop = prompt_shard(cfg.batch_size, layout.dp_rank, layout.dp)
        self.row_start, self.row_stop = first * self.group_size, stop * self.group_size
        self.n_rows = cfg.batch_size * self.group_size

    @property
    def stats_group(self) -> ProcessGroup | None:
        """The group of rlmath's data-parallel statistics (``None``: this process alone)."""
        return self.layout.dp_group if self.layout.distributed else None

    def rollout(self, n_prompts: int, step: int) -> Rollout:
        return collect_rollout(
            self.actor,
            self.task,
            n_prompts=n_prompts,
            group_size=self.group_size,
            temperature=self.cfg.temperature,
            prompt_generator=self.prompt_gen,
            seed=self.cfg.seed,
            step=step,
            device=self.device,
            layout=self.layout,
            **self.cfg.truncation,
        )

    def mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked mean of ``x`` over the valid tokens of the whole (global) batch."""
        return rlmath.masked_mean(x, mask, group=self.stats_group)

    def minibatches(self, batch: Rollout) -> list[Rollout]:
        """This rank's part of each global mini-batch (see :func:`local_minibatches`).

        A rank holding none of a mini-batch's rows gets one of its rows with an
        all-zero response mask: it contributes nothing to the loss or the
        metrics, but runs forward and backward like the others (DDP and FSDP2
        need every rank in every gradient reduction).
        """
        out = []
        for rows in local_minibatches(
            self.n_rows, self.row_start, self.row_stop, self.cfg.mini_batches, self.shuffle_gen
        ):
            if rows.numel():
                out.append(batch.select(rows.to(self.device)))
            else:
                mb = batch.select(torch.zeros(1, dtype=torch.long, device=self.device))
                mb.response_mask = torch.zeros_like(mb.response_mask)
                out.append(mb)
        return out

    def reduce_update_metrics(
        self, metrics: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> dict[str, float]:
        """Global values of one mini-batch's metrics (one all-reduce).

        Losses (:data:`LOSS_METRICS`) are this rank's share times the number
        of data-parallel ranks: their sum over ranks divided by that number is
        the mini-batch's loss. The others are means over this rank's valid
        tokens: weighted by the token counts they are the global means.
        """
        names = list(metrics)
        tokens = mask.to(self.dtype).sum()
        local = torch.stack(
            [
                metrics[k].detach().to(self.dtype) * (1 if k in LOSS_METRICS else tokens)
                for k in names
            ]
            + [tokens]
        )
        total = self.layout.dp_sum(local)
        n = float(total[-1])
        out = {}
        for k, v in zip(names, total[:-1].tolist(), strict=True):
            out[k] = v / self.layout.dp if k in LOSS_METRICS else (v / n if n > 0 else 0.0)
        return out

    @torch.no_grad()
    def score_rollout(self, batch: Rollout) -> dict[str, torch.Tensor]:
        """Fill ``old_log_prob`` and ``ref_log_prob``; return the rollout's statistics.

        ``old_log_prob`` is recomputed by the training forward pass rather than
        taken from sampling, as verl does, so that the first PPO ratio is
        exactly 1 whatever numerical differences sampling has. With a
        truncating sampler every log-prob (and entropy) is taken over the
        sampler's kept set, renormalised, as the rollout drew from it.

        Returns the KL to the reference and the entropy (token means), and
        how far the trainer's log-probs are from the sampler's: the mean of
        the ratio ``π_trainer / π_sampler`` over the valid tokens
        (``rollout_ratio``) and the fraction of tokens where it lies outside
        ``[0.9, 1.1]`` (``rollout_ratio_outside``); ``rollout_ratio_full*``
        are the same with the trainer's log-probs over the full vocabulary
        (the same numbers when the sampler does not truncate).
        """
        mask = batch.response_mask
        truncation = self.cfg.truncation
        temperature = self.cfg.temperature
        cur = response_forward(
            self.actor, batch, temperature=temperature, with_entropy=True, truncation=truncation
        )
        ref = response_forward(self.ref, batch, temperature=temperature, truncation=truncation)
        batch.old_log_prob, batch.ref_log_prob = cur.log_prob, ref.log_prob
        assert cur.entropy is not None
        # k3 is a non-negative, unbiased per-token estimate of KL(π‖π_ref).
        kl = rlmath.kl_penalty(cur.log_prob, ref.log_prob, "low_var_kl")
        stats = {"kl": self.mean(kl, mask), "entropy": self.mean(cur.entropy, mask)}
        full = (
            response_forward(self.actor, batch, temperature=temperature).log_prob
            if truncation
            else cur.log_prob
        )
        for name, log_prob in (("rollout_ratio", cur.log_prob), ("rollout_ratio_full", full)):
            stats.update(self.rollout_ratio_stats(batch, log_prob, name))
        for name, value in stats.items():
            check_finite(name, value)
        return stats

    def rollout_ratio_stats(
        self, batch: Rollout, log_prob: torch.Tensor, name: str
    ) -> dict[str, torch.Tensor]:
        """``name``: the mean of ``exp(log_prob - rollout_log_prob)``; ``name_outside``: its
        fraction of valid tokens outside ``[0.9, 1.1]`` (fp64, over every rank's tokens)."""
        assert batch.rollout_log_prob is not None
        mask = batch.response_mask
        ratio = (log_prob.double() - batch.rollout_log_prob).exp()
        outside = ((ratio < 0.9) | (ratio > 1.1)).double()
        return {name: self.mean(ratio, mask), f"{name}_outside": self.mean(outside, mask)}

    def actor_loss(
        self,
        mb: Rollout,
        out_log_prob: torch.Tensor,
        entropy: torch.Tensor,
        info: Aggregation,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped policy loss minus the entropy bonus; GRPO adds its KL loss on top.

        ``info`` holds the mini-batch's global counts (``rlmath.global_batch_info``).
        """
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
            **info,
        )
        entropy_loss = rlmath.agg_loss(
            entropy, mb.response_mask, loss_agg_mode=cfg.loss_agg_mode, **info
        )
        loss = pg_loss - cfg.entropy_coef * entropy_loss
        return loss, {"pg_loss": pg_loss.detach(), **pg_metrics}

    def update_actor(self, batch: Rollout) -> dict[str, float]:
        """``ppo_epochs`` passes of ``mini_batches`` clipped-loss updates; mean metrics."""
        cfg = self.cfg
        self.actor.train()
        sums: dict[str, float] = {}
        n = 0
        for _ in range(cfg.ppo_epochs):
            for mb in self.minibatches(batch):
                out = response_forward(
                    self.actor, mb, temperature=cfg.temperature, with_entropy=True,
                    truncation=cfg.truncation,
                )  # fmt: skip
                assert out.entropy is not None
                info = rlmath.global_batch_info(mb.response_mask, group=self.stats_group)
                loss, metrics = self.actor_loss(mb, out.log_prob, out.entropy, info)
                reduced = self.reduce_update_metrics({**metrics, "loss": loss}, mb.response_mask)
                # Stop at the first non-finite number, before it reaches the weights
                # (the reduced values are the same on every rank, so all stop together).
                for name in (*self.loss_metrics, "loss"):
                    if name in reduced:
                        check_finite(name, reduced[name])
                del reduced["loss"]
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = clip_grad_norm(self.actor, cfg.max_grad_norm, self.layout)
                reduced["grad_norm"] = check_finite("grad_norm", grad_norm)
                self.optimizer.step()
                for k, v in reduced.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        return {k: v / max(n, 1) for k, v in sums.items()}

    @abstractmethod
    def train_step(self, step: int) -> dict[str, float]:
        """RL step ``step`` (1-based); returns the step's metrics."""

    def step(self, step: int) -> dict[str, float]:
        """Run one step and time it; adds ``step``, ``lr`` and ``tokens_per_s``."""
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        metrics = self.train_step(step)
        self.scheduler.step()
        dt = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.pop("_tokens") / dt
        metrics["step_time_s"] = dt
        return {"step": step, "lr": lr, **metrics}

    def rollout_metrics(self, batch: Rollout) -> dict[str, float]:
        """Means over the whole step's rows (every rank's), and the step's token count."""
        assert batch.scores is not None
        scores = batch.scores.to(self.dtype)
        sums = self.layout.dp_sum(
            torch.stack(
                [
                    scores.sum(),
                    (scores == 1.0).to(self.dtype).sum(),
                    batch.response_mask.sum().to(self.dtype),
                    batch.attention_mask.sum().to(self.dtype),
                ]
            )
        ).tolist()
        return {
            "reward_mean": sums[0] / self.n_rows,
            "success_rate": sums[1] / self.n_rows,
            "response_length": sums[2] / self.n_rows,
            # Valid prompt + response tokens processed this step over all ranks
            # (sampled, then scored and trained on ppo_epochs times).
            "_tokens": sums[3],
        }
