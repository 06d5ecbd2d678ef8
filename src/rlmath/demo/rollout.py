"""Rollout: sample prompts, generate responses, score them with the task."""

from __future__ import annotations

import torch

from rlmath.demo.batch import Rollout, left_pad, make_rollout
from rlmath.demo.model import DemoLM
from rlmath.demo.sampling import generate
from rlmath.demo.task import SortTask

__all__ = ["collect_rollout", "greedy_success_rate", "token_level_scores"]


def collect_rollout(
    policy: DemoLM,
    task: SortTask,
    *,
    n_prompts: int,
    group_size: int,
    temperature: float,
    prompt_generator: torch.Generator,
    sample_generator: torch.Generator,
    device: torch.device,
) -> Rollout:
    """Sample ``n_prompts`` prompts, ``group_size`` responses each, and score them.

    Rows ``i * group_size … (i + 1) * group_size - 1`` answer prompt ``i``
    and carry ``index == i``. ``Rollout.scores`` holds the task reward
    ``[B]`` (exactly 1.0 for a correct answer).
    """
    vocab = task.vocab
    digits = task.sample_digits(n_prompts, prompt_generator)
    digits = [d for d in digits for _ in range(group_size)]
    prompt_ids, prompt_mask = left_pad([task.prompt_ids(d) for d in digits], vocab.pad_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    responses = generate(
        policy,
        prompt_ids,
        prompt_mask,
        max_new_tokens=task.max_response_len,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
        temperature=temperature,
        generator=sample_generator,
    )
    index = torch.arange(n_prompts, device=device).repeat_interleave(group_size)
    batch = make_rollout(prompt_ids, prompt_mask, responses, index, eos_id=vocab.eos_id)
    batch.scores = task.score(digits, responses.cpu()).to(device)
    return batch


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward ``[B]`` on its last valid response token: ``[B, R]`` fp32.

    This is how an outcome reward enters token-level RL math: every other
    token gets 0 (PPO then adds the per-token KL penalty).
    """
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    return out.scatter(1, last[:, None], scores.float()[:, None])


@torch.no_grad()
def greedy_success_rate(
    policy: DemoLM,
    task: SortTask,
    *,
    n_prompts: int,
    generator: torch.Generator,
    device: torch.device,
) -> float:
    """Exact-match rate of greedy answers to ``n_prompts`` fresh prompts."""
    vocab = task.vocab
    digits = task.sample_digits(n_prompts, generator)
    prompt_ids, prompt_mask = left_pad([task.prompt_ids(d) for d in digits], vocab.pad_id)
    responses = generate(
        policy,
        prompt_ids.to(device),
        prompt_mask.to(device),
        max_new_tokens=task.max_response_len,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
        temperature=0.0,
    )
    return float((task.score(digits, responses.cpu()) == 1.0).float().mean())
