"""The demo's truncating sampler and the trainer's log-probs over the same kept set."""

import pytest
import torch

import rlmath
from rlmath.demo import DemoConfig
from rlmath.demo.grpo import GRPOTrainer
from rlmath.demo.metrics import read_metrics
from rlmath.demo.model import ModelConfig, build_model
from rlmath.demo.runner import run_demo
from rlmath.demo.sampling import truncate_probs
from rlmath.demo.task import SortTask, Vocab

CASES = [
    {"top_p": 0.8},
    {"top_p": 0.3},
    {"top_k": 1},
    {"top_k": 5},
    {"min_p": 0.1},
    {"top_k": 7, "top_p": 0.6},
    {"min_p": 0.05, "top_k": 9, "top_p": 0.9},
    {"top_p": 1.0, "top_k": 40, "min_p": 0.0},  # no truncation at all
]


@pytest.mark.parametrize("integer_logits", [False, True], ids=["continuous", "ties"])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampler_kept_set_is_rlmaths_vllm_rule(params, integer_logits):
    # The demo's sort-based sampler (the "rollout engine") and rlmath's threshold search
    # (what the trainer uses) keep the same tokens, ties at the threshold included.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 23, generator=gen, dtype=torch.float64) * 2.5
    if integer_logits:
        logits = logits.round()  # many exact ties
    temperature = 0.7
    probs = torch.softmax(logits / temperature, -1)
    kept = truncate_probs(probs, **params) > 0
    labels = probs.argmax(-1)  # always kept
    got = rlmath.log_probs_from_logits(
        logits, labels, temperature=temperature, kept_stats=True, **params
    )
    assert torch.equal(got.kept_count, kept.sum(-1))
    assert not got.outside.any()
    # Renormalised over the kept set: log(p_label / kept mass).
    want = (probs.gather(-1, labels[:, None]).squeeze(-1) / (probs * kept).sum(-1)).log()
    torch.testing.assert_close(got.log_probs, want, rtol=0, atol=1e-12)


def test_truncate_probs_keeps_the_largest_token():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]], dtype=torch.float64)
    assert (truncate_probs(probs, top_p=1e-9) > 0).tolist() == [
        [True, False, False],
        [False, False, True],
    ]
    assert (truncate_probs(probs, min_p=1.0) > 0).sum().item() == 2
    # top_p counts the mass *before* a token: 0.5 < 0.6 keeps the second token.
    assert (truncate_probs(probs, top_p=0.6)[0] > 0).tolist() == [True, True, False]


def _tiny(**kw) -> DemoConfig:
    base = dict(
        algo="grpo", steps=1, batch_size=4, group_size=3, seed=0, progress=False, d_model=32,
        n_layers=1, n_heads=2, warmup_steps=2, warmup_examples=8, mini_batches=2,
        ppo_epochs=1, lr_warmup_steps=1,
    )  # fmt: skip
    base.update(kw)
    return DemoConfig(**base)


def _first_rollout(cfg: DemoConfig):
    torch.manual_seed(0)
    vocab = Vocab()
    task = SortTask(vocab, min_len=cfg.min_len, max_len=cfg.max_len)
    model_cfg = ModelConfig(
        vocab_size=vocab.size, max_len=task.max_prompt_len + task.max_response_len,
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=4 * cfg.d_model,
    )  # fmt: skip
    policy = build_model(cfg.model, model_cfg).to(getattr(torch, cfg.dtype))
    trainer = GRPOTrainer(cfg, policy, task, torch.device("cpu"))
    batch = trainer.rollout(cfg.batch_size, 1)
    stats = trainer.score_rollout(batch)
    return batch, stats


@pytest.mark.parametrize(
    "params", [{"top_p": 0.8}, {"top_k": 3}, {"min_p": 0.2, "top_p": 0.9}], ids=str
)
def test_first_step_ratio_is_one_in_fp64_with_matching(params):
    batch, stats = _first_rollout(_tiny(dtype="float64", **params))
    mask = batch.response_mask.bool()
    assert batch.rollout_log_prob is not None and batch.old_log_prob is not None
    # The same fp64 model on both sides: only summation order separates the sampler's
    # log-prob from the trainer's (a few fp64 roundings of numbers of order 1).
    ratio = (batch.old_log_prob.double() - batch.rollout_log_prob).exp()[mask]
    assert float((ratio - 1).abs().max()) <= 1e-9
    assert abs(float(stats["rollout_ratio"]) - 1) <= 1e-6
    assert float(stats["rollout_ratio_outside"]) == 0.0
    # Over the full vocabulary the trainer's probability is the sampler's times the
    # kept mass: never above it, and below it wherever the sampler cut something.
    assert float(stats["rollout_ratio_full"]) < 1 - 1e-3


def test_without_truncation_both_ratios_are_the_same():
    _, stats = _first_rollout(_tiny(dtype="float64"))
    assert float(stats["rollout_ratio"]) == float(stats["rollout_ratio_full"])
    assert abs(float(stats["rollout_ratio"]) - 1) <= 1e-6


@pytest.mark.integration
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_truncated_run_logs_both_ratios(algo, tmp_path):
    run_demo(_tiny(algo=algo, steps=2, out=tmp_path, top_p=0.8, top_k=8))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 2
    for r in records:
        # fp32 model, fp64 sampler: the matched ratio is 1 to fp32 rounding.
        assert abs(r["rollout_ratio"] - 1) <= 1e-5 and r["rollout_ratio_outside"] == 0.0
        assert r["rollout_ratio_full"] < 1 - 1e-3 and r["rollout_ratio_full_outside"] > 0
