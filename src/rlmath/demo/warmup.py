"""A short supervised warm-up that teaches the answer *format*, not the task.

A freshly initialized model emits random tokens of the whole vocabulary, so
RL would spend its first minutes discovering that an answer is a few digits
followed by ``<eos>``. The warm-up fine-tunes the model on a small fixed set
of prompts whose targets are the prompt's digits in a *random order* (a
shuffled copy, closed by ``<eos>``). That teaches the length and the
alphabet of an answer (and to reuse the prompt's digits) but says nothing
about the order: after the warm-up a sampled answer is sorted only by
chance, so the success rate starts low and every bit of sorting that follows
is learned by RL.

The loss is the mean negative log-likelihood of the target tokens, computed
with the same packed path (``rlmath.log_probs_from_logits_response_rmpad``)
and ``rlmath.masked_mean``.
"""

from __future__ import annotations

import torch

import rlmath
from rlmath.demo.batch import ResponseModel, left_pad, make_rollout, response_forward
from rlmath.demo.model import DemoLM
from rlmath.demo.task import SortTask

__all__ = ["supervised_warmup"]


def _shuffled_targets(
    task: SortTask, digits: list[list[int]], g: torch.Generator
) -> list[list[int]]:
    out = []
    for d in digits:
        perm = torch.randperm(len(d), generator=g).tolist()
        out.append([task.vocab.symbol_id(d[i]) for i in perm] + [task.vocab.eos_id])
    return out


def supervised_warmup(
    model: DemoLM,
    task: SortTask,
    *,
    steps: int,
    examples: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    device: torch.device,
) -> list[float]:
    """Fine-tune ``model`` in place for ``steps`` steps; returns the loss per step.

    ``examples`` prompts are drawn once; each step takes ``batch_size`` of
    them at random and a fresh random order of each one's digits as target.
    """
    if steps <= 0:
        return []
    pool = task.sample_digits(examples, generator)
    forward = ResponseModel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    vocab = task.vocab
    for _ in range(steps):
        rows = torch.randint(0, len(pool), (batch_size,), generator=generator).tolist()
        digits = [pool[i] for i in rows]
        prompt_ids, prompt_mask = left_pad([task.prompt_ids(d) for d in digits], vocab.pad_id)
        targets = _shuffled_targets(task, digits, generator)
        width = task.max_response_len
        response = torch.full((len(rows), width), vocab.pad_id, dtype=torch.long)
        for i, t in enumerate(targets):
            response[i, : len(t)] = torch.tensor(t)
        batch = make_rollout(
            prompt_ids.to(device),
            prompt_mask.to(device),
            response.to(device),
            torch.tensor(rows, device=device),
            eos_id=vocab.eos_id,
        )
        log_prob = response_forward(forward, batch).log_prob
        loss = -rlmath.masked_mean(log_prob, batch.response_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
