"""Rollout: sample prompts, generate responses, score them with the task.

Every rank draws the prompts of the whole step from the same generator and
keeps its own share (:func:`rlmath.demo.parallel.prompt_shard`); a GRPO group
(one prompt's responses) stays on one rank. Rows are numbered globally
(prompt ``i``'s responses are rows ``i·G … i·G + G − 1``) and each row samples
from its own stream (:func:`rlmath.demo.sampling.sample_uniforms`).
"""

from __future__ import annotations

import torch
from torch import nn

from rlmath.demo.batch import Rollout, left_pad, make_rollout
from rlmath.demo.parallel import Layout, prompt_shard
from rlmath.demo.sampling import generate, sample_uniforms
from rlmath.demo.task import SortTask

__all__ = ["collect_rollout", "greedy_success_rate", "token_level_scores"]


def collect_rollout(
    policy: nn.Module,
    task: SortTask,
    *,
    n_prompts: int,
    group_size: int,
    temperature: float,
    prompt_generator: torch.Generator,
    seed: int,
    step: int,
    device: torch.device,
    layout: Layout | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Rollout:
    """This rank's share of ``n_prompts`` prompts, ``group_size`` responses each, scored.

    ``policy`` is a :class:`rlmath.demo.batch.ResponseModel` (or its
    data-parallel wrapper). Rows ``i * group_size … (i + 1) * group_size - 1``
    answer global prompt ``i`` and carry ``index == i``; row ``k``'s tokens
    are drawn from the stream of ``(seed, step, k)``. ``Rollout.scores``
    holds the task reward ``[B]`` (exactly 1.0 for a correct answer) and
    ``Rollout.rollout_log_prob`` the sampler's log-probability of each response
    token (``[B, R]``, at ``temperature`` under the kept set of ``top_k`` /
    ``top_p`` / ``min_p``; 0 on padding), as a rollout engine reports it.
    """
    layout = layout or Layout()
    vocab = task.vocab
    first, stop = prompt_shard(n_prompts, layout.dp_rank, layout.dp)
    digits = task.sample_digits(n_prompts, prompt_generator)[first:stop]
    digits = [d for d in digits for _ in range(group_size)]
    rows = range(first * group_size, stop * group_size)
    prompt_ids, prompt_mask = left_pad([task.prompt_ids(d) for d in digits], vocab.pad_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    responses, sampled_log_probs = generate(
        policy,
        prompt_ids,
        prompt_mask,
        max_new_tokens=task.max_response_len,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
        temperature=temperature,
        uniforms=sample_uniforms(seed, step, rows, task.max_response_len),
        stop_early=not layout.distributed,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    index = torch.arange(first, stop, device=device).repeat_interleave(group_size)
    batch = make_rollout(prompt_ids, prompt_mask, responses, index, eos_id=vocab.eos_id)
    batch.scores = task.score(digits, responses.cpu()).to(device)
    batch.rollout_log_prob = torch.where(batch.response_mask.bool(), sampled_log_probs, 0.0)
    return batch


def token_level_scores(
    scores: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Place each sequence's reward ``[B]`` on its last valid response token: ``[B, R]``.

    This is how an outcome reward enters token-level RL math: every other
    token gets 0 (PPO then adds the per-token KL penalty).
    """
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=scores.device)
    return out.scatter(1, last[:, None], scores.to(dtype)[:, None])


@torch.no_grad()
def greedy_success_rate(
    policy: nn.Module,
    task: SortTask,
    *,
    n_prompts: int,
    generator: torch.Generator,
    device: torch.device,
    layout: Layout | None = None,
) -> float:
    """Exact-match rate of greedy answers to ``n_prompts`` fresh prompts.

    The prompts are shared out over the data-parallel ranks (unevenly when
    they do not divide) and the successes summed over them.
    """
    layout = layout or Layout()
    vocab = task.vocab
    digits = task.sample_digits(n_prompts, generator)
    first = layout.dp_rank * n_prompts // layout.dp
    digits = digits[first : (layout.dp_rank + 1) * n_prompts // layout.dp]
    prompt_ids, prompt_mask = left_pad([task.prompt_ids(d) for d in digits], vocab.pad_id)
    responses, _ = generate(
        policy,
        prompt_ids.to(device),
        prompt_mask.to(device),
        max_new_tokens=task.max_response_len,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
        temperature=0.0,
        stop_early=not layout.distributed,
    )
    wins = (task.score(digits, responses.cpu()) == 1.0).sum().to(torch.float64)
    return float(layout.dp_sum(wins.to(device))) / n_prompts
