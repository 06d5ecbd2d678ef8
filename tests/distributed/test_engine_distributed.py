"""DTensor inputs and the shared autograd functions, on 2 gloo ranks.

DTensor logits sharded over the vocabulary run the vocabulary-parallel
operation over the mesh's group; replicated and row-sharded ones run locally;
values and gradients equal the single-process functions on the full tensors.
The single-process and vocabulary-parallel results of each operation come
from the same autograd function.
"""

from __future__ import annotations

import pytest
import torch

from rlmath.distributed import run_distributed

from .engine_workers import problem, single_logits, worker

TOL = 1e-12


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("case", "placement"),
    [("shard_vocab", "Shard(dim=2)"), ("replicate", "Replicate()"), ("shard_rows", "Shard(dim=0)")],
)
def test_dtensor_logits_equal_the_full_tensor(results, case, placement):
    expected_out = "Replicate()" if case != "shard_rows" else "Shard(dim=0)"
    for r in results:
        res = r[case]
        assert res["is_dtensor"]
        assert res["placements"] == [[expected_out]] * 3
        for key in ("lp", "ent", "kl", "gx", "gr"):
            assert res[key] < TOL, (case, key, res[key])
        assert res["gx_placement"] == [placement]


@pytest.mark.integration
@pytest.mark.parametrize("case", ["kept_shard_vocab", "kept_shard_vocab_ids", "kept_shard_rows"])
def test_dtensor_logits_under_a_samplers_kept_set_equal_the_full_tensor(results, case):
    """Per-row ``top_p`` with ``top_k`` and ``min_p``, or replayed ids, on DTensor logits sharded
    over the vocabulary (the kept set found over the mesh's group) or over rows: values,
    gradients, kept-set sizes and ``outside`` as on the full tensor."""
    for r in results:
        res = r[case]
        assert res["is_dtensor"] and res["outside"] and res["count"] and res["some_cut"]
        for key in ("lp", "ent", "gx"):
            assert res[key] < TOL, (case, key, res[key])


@pytest.mark.integration
def test_bad_sampler_arguments_with_dtensor_logits_raise_naming_them(results):
    for r in results:
        err = r["kept_errors"]
        assert err["placement"].startswith("TypeError") and "top_p" in err["placement"]
        assert err["shape"].startswith("ValueError") and "top_p" in err["shape"]
        assert err["range"].startswith("ValueError") and "top_p" in err["range"]
        assert err["kept_shape"].startswith("ValueError") and "kept" in err["kept_shape"]


@pytest.mark.integration
def test_dtensor_head_under_a_samplers_kept_set_equals_the_full_tensors(results):
    for r in results:
        res = r["kept_head"]
        assert res["is_dtensor"] and res["outside"] and res["count"] and res["some_cut"]
        for key in ("lp", "ent", "gh", "gw", "gb"):
            assert res[key] < TOL, (key, res[key])


@pytest.mark.integration
def test_a_plain_reference_tensor_gets_each_ranks_share(results):
    want = single_logits(problem())["gr"]
    local = [r["shard_vocab_plain_ref"]["gr_local"] for r in results]
    assert not results[0]["shard_vocab_plain_ref"]["gr_dtensor"]
    # Rank k's gradient is the single-process gradient on its vocabulary columns.
    torch.testing.assert_close(local[0][..., :7], want[..., :7], rtol=0, atol=TOL)
    torch.testing.assert_close(local[1][..., 7:], want[..., 7:], rtol=0, atol=TOL)
    for key in ("lp", "ent", "kl", "gx"):
        assert results[0]["shard_vocab_plain_ref"][key] < TOL


@pytest.mark.integration
def test_dtensor_head_is_vocabulary_parallel(results):
    for r in results:
        for key in ("lp", "ent", "gh", "gw", "gb"):
            assert r["head"][key] < TOL, (key, r["head"][key])
        assert "FSDP2" in r["head"]["plain_hidden_error"]


@pytest.mark.integration
def test_unsupported_placements_raise_type_error(results):
    for r in results:
        assert "placement Partial" in r["partial_error"]


@pytest.mark.integration
def test_single_process_and_vocabulary_parallel_share_the_autograd_function(results):
    expected = {
        "log_probs": ["LogProbsEntropyFunctionBackward"],
        "entropy": ["LogProbsEntropyFunctionBackward"],
        "kl": ["KLFunctionBackward"],
        "fused_head": ["FusedHeadFunctionBackward"],
    }
    for r in results:
        for op, (single, parallel) in r["same_functions"].items():
            assert single == parallel == expected[op], op


@pytest.mark.integration
def test_ignored_rows_temperature_reaches_no_vocab_parallel_gradient(results):
    for r in results:
        assert r["ignored_rows_temperature"] == {"0.0": True, "nan": True}
