"""Per-sample random streams and the inverse-CDF sampler: layout-independent sampling."""

import pytest
import torch

from rlmath.demo.batch import ResponseModel, left_pad
from rlmath.demo.model import ModelConfig, TinyTransformer
from rlmath.demo.sampling import generate, inverse_cdf_sample, sample_seed, sample_uniforms
from rlmath.demo.task import SortTask, Vocab
from rlmath.demo.trainer import local_minibatches, minibatches


def test_sample_seeds_are_deterministic_and_distinct():
    seeds = {sample_seed(s, t, i) for s in range(3) for t in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert sample_seed(7, 2, 11) == sample_seed(7, 2, 11)
    assert all(0 <= x < 2**63 for x in seeds)


def test_a_rows_uniforms_do_not_depend_on_the_other_rows():
    both = sample_uniforms(0, 5, [3, 9], 6)
    assert both.dtype == torch.float64 and both.shape == (2, 6)
    assert torch.equal(both[1], sample_uniforms(0, 5, [9], 6)[0])
    assert torch.equal(both[0], sample_uniforms(0, 5, range(3, 4), 6)[0])
    assert not torch.equal(both[0], both[1])
    assert not torch.equal(both[0], sample_uniforms(0, 6, [3], 6)[0])  # another step
    assert ((both >= 0) & (both < 1)).all()


def test_inverse_cdf_sample_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = inverse_cdf_sample(probs.expand(n, 4), u)
    freq = torch.bincount(draws, minlength=4).double() / n
    # 5 standard deviations of a binomial frequency: sqrt(p(1-p)/n) <= 0.0025.
    assert torch.allclose(freq, probs, atol=5 * 0.0025)
    assert freq[1] == 0  # probability 0: never drawn


def test_inverse_cdf_sample_edges():
    probs = torch.tensor([[0.0, 0.5, 0.5], [0.25, 0.25, 0.5]], dtype=torch.float64)
    # u = 0 takes the first token of positive probability; u -> 1 the last.
    assert inverse_cdf_sample(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]
    top = torch.full((2,), 1 - 2**-53, dtype=torch.float64)
    assert inverse_cdf_sample(probs, top).tolist() == [2, 2]
    # Unnormalized weights are normalized by their sum.
    assert inverse_cdf_sample(probs * 7, torch.tensor([0.6, 0.3])).tolist() == [2, 1]


@pytest.fixture
def model_and_prompts():
    torch.manual_seed(0)
    vocab = Vocab()
    task = SortTask(vocab, min_len=2, max_len=5)
    lm = TinyTransformer(
        ModelConfig(vocab.size, max_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    ).double()
    digits = task.sample_digits(6, torch.Generator().manual_seed(1))
    return ResponseModel(lm), task, digits


def _sample(model, task, digits, rows):
    ids, mask = left_pad([task.prompt_ids(digits[r]) for r in rows], task.vocab.pad_id)
    return generate(
        model, ids, mask, max_new_tokens=task.max_response_len, eos_id=task.vocab.eos_id,
        pad_id=task.vocab.pad_id, uniforms=sample_uniforms(0, 1, rows, task.max_response_len),
    ).tokens  # fmt: skip


def test_a_samples_tokens_do_not_depend_on_its_batch(model_and_prompts):
    model, task, digits = model_and_prompts
    together = _sample(model, task, digits, list(range(6)))
    # Other batch sizes, other padding widths, another order: the same tokens per row.
    for rows in ([4], [5, 0], [3, 1, 2]):
        alone = _sample(model, task, digits, rows)
        for i, r in enumerate(rows):
            assert torch.equal(alone[i], together[r])


def test_sampling_needs_uniforms(model_and_prompts):
    model, task, digits = model_and_prompts
    ids, mask = left_pad([task.prompt_ids(digits[0])], task.vocab.pad_id)
    with pytest.raises(ValueError, match=r"uniforms of shape \(1, 6\)"):
        generate(model, ids, mask, max_new_tokens=6, eos_id=3, pad_id=0)
    greedy = generate(model, ids, mask, max_new_tokens=6, eos_id=3, pad_id=0, temperature=0)
    assert greedy.tokens.shape == (1, 6)
    assert torch.equal(greedy.log_probs, torch.zeros(1, 6, dtype=torch.float64))


@pytest.mark.parametrize(("n", "n_mini", "ranks"), [(16, 2, 2), (8, 4, 4), (12, 5, 3), (4, 4, 2)])
def test_local_minibatches_partition_each_global_minibatch(n, n_mini, ranks):
    share = n // ranks
    local = [
        local_minibatches(n, r * share, (r + 1) * share, n_mini, torch.Generator().manual_seed(3))
        for r in range(ranks)
    ]
    expected = minibatches(n, n_mini, torch.Generator().manual_seed(3))
    for m, rows in enumerate(expected):
        pieces = [local[r][m] + r * share for r in range(ranks)]
        assert all(((p >= r * share) & (p < (r + 1) * share)).all() for r, p in enumerate(pieces))
        assert sorted(torch.cat(pieces).tolist()) == sorted(rows.tolist())
