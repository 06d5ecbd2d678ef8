"""``rlmath bench``: its tables, its baselines, its busy processes and its argument checks.

Nothing here times anything or depends on speed: the tables are checked for
their shape and names, the baselines for computing what rlmath computes, and
the busy processes for being alive during their block and ended after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rlmath as R
from rlmath import cli
from rlmath.bench import (
    BenchSettingError,
    baselines,
    fused_head,
    logprobs,
    run,
    session,
    small,
    verl_formulas,
)
from rlmath.bench.advantages import GAMMA_LAM, gae_inputs, outcome_inputs
from rlmath.bench.busy import BusyLoad, check_busy_cores
from rlmath.bench.memory import peak_rss_bytes, rss_measurable
from rlmath.engine.torch_backend import cpu_matmul
from rlmath.fused_head import log_probs_and_entropy_from_hidden

CORES = os.cpu_count() or 1
K = min(2, CORES)


def _table_rows(out: str, first_column: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose first column is ``first_column``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    width = lines[start].count("|")
    assert lines[start + 1] == "|" + "---|" * (width - 1)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        assert line.count("|") == width, line
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _gone(process: subprocess.Popen[bytes]) -> bool:
    """Ended and reaped: no process has its pid any more."""
    if process.poll() is None:
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False


# ----------------------------------------------------------------------------- the command


def test_bench_advantages_quick_prints_its_tables(capsys):
    threads = torch.get_num_threads()
    argv = ["bench", "advantages", "--quick", "--threads", "1", "--repeats", "5", "--no-peers"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "### GAE" in out and "### Outcome estimators" in out
    assert out.count(f"torch {torch.__version__}, 1 thread, cpu;") == 2
    assert out.count("load: 0 busy processes, load average at the start") == 2
    gae = _table_rows(out, "T")
    head = out.splitlines()[[line.startswith("| T |") for line in out.splitlines()].index(True)]
    assert "rlmath ms" in head and "loop ms" in head and "verl" not in head
    assert len(gae) == 2 * len(GAMMA_LAM)
    for row in gae:
        assert row[4].endswith("×") and float(row[2]) > 0 and float(row[3]) > 0
    outcome = _table_rows(out, "estimator")
    names = [row[0] for row in outcome]
    assert names[:2] == ["grpo", "grpo (uid strings)"] and "rloo" in names
    assert names[-1] == "grpo vs a per-sample loop over torch scalars"
    head = next(line for line in out.splitlines() if line.startswith("| estimator |"))
    assert "rlmath ms" in head and "reference loop ms" in head
    # The thread count is the run's only: torch's setting is restored afterwards.
    assert torch.get_num_threads() == threads


def test_bench_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--quick", "--busy-cores", "--repeats", "--threads", "--no-peers"):
        assert flag in out
    for area in ("logprobs", "fused-head", "advantages", "small", "all"):
        assert area in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--busy-cores", "-1"], "argument --busy-cores: must be >= 0, got -1"),
        (["--busy-cores", "10000"], f"argument --busy-cores: must be <= {CORES}, got 10000"),
        (["--busy-cores", "two"], "argument --busy-cores: expected an integer, got 'two'"),
        (["everything"], "argument AREA: invalid choice: 'everything'"),
        (["--repeats", "1"], "argument --repeats: must be >= 5, got 1"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "advantages", "--quick", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: CUDA is not available on this machine" in capsys.readouterr().err


def test_run_checks_its_settings_before_any_work():
    with pytest.raises(BenchSettingError, match="unknown area 'everything'"):
        run("everything")
    with pytest.raises(BenchSettingError, match=r"repeats must be an int in \[5, 1000\]"):
        run("advantages", repeats=2)
    with pytest.raises(BenchSettingError, match="busy_cores must be in"):
        run("advantages", busy_cores=CORES + 1)


# ----------------------------------------------------------------------------- the other tables


def test_logprobs_table_names_rlmath_and_the_baseline(capsys):
    with session(peers=False, rss=False) as setting:
        logprobs.run(setting, repeats=5, shapes=[(16, 100)], dtypes=["float32"])
    rows = _table_rows(capsys.readouterr().out, "logits")
    impls = [(row[2], row[3]) for row in rows]
    assert impls == [
        ("log_probs", "naive log_softmax+gather"),
        ("log_probs", "rlmath"),
        ("log_probs + entropy", "naive log_softmax+gather"),
        ("log_probs + entropy", "naive + entropy"),
        ("log_probs + entropy", "rlmath"),
    ]
    for row in rows:
        assert all(float(e) < 1e-4 for e in row[-1].split(" / "))
    assert rows[0][5] == "1.00" and rows[0][7] == "1.00"  # the baseline's own ratio


def test_small_table_times_every_listed_function(capsys):
    functions = ["log_probs_from_logits", "kl_from_logits", "agg_loss token-mean"]  # table order
    with session(peers=False, rss=False, threads=1) as setting:
        small.run(setting, quick=True, repeats=5, functions=functions)
    out = capsys.readouterr().out
    assert "verl: no" in out and "1 thread" in out
    rows = _table_rows(out, "function")
    assert [row[0] for row in rows] == functions
    assert [row[1:3] for row in rows] == [["(8, 32000)", "bfloat16"], ["(8, 32000)", "bfloat16"],
                                          ["(8, 1024)", "float32"]]  # fmt: skip
    for row in rows:
        assert float(row[3]) > 0 and float(row[6]) > 0  # rlmath and naive µs
        assert row[5] == row[8] == "n/a"  # verl not imported, no peers
        assert float(row[9]) > 0
    assert rows[0][4] != "n/a" and float(rows[0][7]) > 0
    assert rows[1][4] == rows[1][7] == "n/a"  # verl has no exact KL over the vocabulary
    # The accuracy of the same vocabulary calls against fp64: rlmath computes bf16 logits in
    # fp32, within 8·eps·(|z|max + log V + 1) ≈ 1e-5 for these N(0, 2²) logits (|z|max ≈ 9,
    # eps = 2^-24); verl's formula runs log_softmax in bf16, whose outputs carry 8 significant
    # bits (half an ulp is 3.1e-2 for log-probs between -16 and -8).
    acc = _table_rows(out, "outputs of")
    assert [row[:3] for row in acc] == [[f, "(8, 32000)", "bfloat16"] for f in functions[:2]]
    assert all(float(row[3]) < 1e-5 and float(row[6]) < 1e-4 for row in acc)  # rlmath, naive
    assert float(acc[0][4]) > 1e-3 and acc[1][4] == "n/a"
    assert acc[0][5] == acc[1][5] == "n/a"  # verl itself not imported


def test_small_cases_cover_every_function_group():
    names = {case[0] for case in small.CASES}
    for name in (*small.VOCAB_FUNCTIONS, "policy loss vanilla", "compute_value_loss",
                 "compute_entropy_loss", "kl_penalty k3", "compute_gae_advantage_return",
                 "compute_grpo_outcome_advantage", "masked_mean", "masked_whiten"):  # fmt: skip
        assert name in names
    for mode in R.LOSS_AGG_MODES:
        assert f"agg_loss {mode}" in names or mode in ("token-sum", "prompt-mean")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.detach().double(), b.detach().double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", [c for c in small.CASES if c[2] == "float32"], ids=str)
def test_verl_formulas_compute_what_rlmath_computes(case):
    """On the benchmark's (finite) inputs the verl formulas agree with rlmath where their
    semantics coincide: the ratios compare two ways of getting one result."""
    function = case[0]
    calls = small.case_calls(*case, peers=False)
    if calls.get("verl formula") is None:
        pytest.skip("no verl formula")
    ours, theirs = calls["rlmath"](), calls["verl formula"]()
    if function == "agg_loss seq-mean-token-sum-norm":
        # verl divides by the constant only, rlmath by the sequences too.
        _close(ours * small.B, theirs, 1e-5)
        return
    if function == "compute_gae_advantage_return":
        d = small._tokens(torch.device("cpu"))
        # rlmath's advantages are 0 at masked positions, verl whitens them too.
        _close(ours[0][d["mask"]], theirs[0][d["mask"]], 1e-4)
        return
    if function == "masked_whiten":
        mask = small._tokens(torch.device("cpu"))["mask"]
        _close(ours[mask], theirs[mask], 1e-5)
        return
    if isinstance(ours, tuple) and isinstance(ours[1], dict):  # (loss, metrics)
        ours = ours[0]
        theirs = theirs[0]
    elif isinstance(ours, tuple):
        ours, theirs = ours[0], theirs[0]
    _close(ours, theirs, 1e-5)


def test_verl_formula_log_probs_match_rlmath_in_both_dtypes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 300, (4,), generator=g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        _close(verl_formulas.logprobs_from_logits(x.to(dtype), labels),
               R.log_probs_from_logits(x.to(dtype), labels), tol)  # fmt: skip
    _close(verl_formulas.entropy_from_logits(x.float()), R.entropy_from_logits(x.float()), 1e-5)


def test_fused_head_table_names_rlmath_and_the_baselines(capsys, matmul_library):
    with session(peers=False, rss=False) as setting:
        fused_head.run(setting, repeats=5, shapes=[(16, 8, 100)], dtypes=["float32"])
    out = capsys.readouterr().out
    library = "oneDNN" if matmul_library == "onednn" else "torch's BLAS"
    assert f"the fused head's fp32 matmuls: {library}" in out
    rows = _table_rows(out, "N×H×V")
    onednn_row = [fused_head.ONEDNN_UNFUSED] if cpu_matmul.onednn_available() else []
    assert [row[2] for row in rows] == ["unfused", "rlmath fused", *onednn_row]
    assert rows[0][4] == "1.00"
    for row in rows:
        assert all(float(e) < 1e-4 for e in row[-1].split(" / "))


def test_fused_head_table_has_no_onednn_row_for_half_inputs(capsys):
    with session(peers=False, rss=False) as setting:
        fused_head.run(setting, repeats=5, shapes=[(16, 8, 100)], dtypes=["bfloat16"])
    rows = _table_rows(capsys.readouterr().out, "N×H×V")
    assert [row[2] for row in rows] == ["unfused", "rlmath fused"]


@pytest.mark.skipif(not rss_measurable(), reason="needs Linux's /proc/self/clear_refs")
def test_memory_columns_report_peak_rss_beside_the_tracker(capsys):
    with session(peers=False, threads=2) as setting:
        logprobs.run(setting, repeats=5, shapes=[(64, 3000)], dtypes=["float32"],
                     functions=["log_probs"])  # fmt: skip
        fused_head.run(setting, repeats=5, shapes=[(64, 8, 3000)], dtypes=["float32"])
    out = capsys.readouterr().out
    for first, mib_column in (("logits", 10), ("N×H×V", 7)):
        rows = _table_rows(out, first)
        assert rows
        for row in rows:
            # An integer (a call as small as its warm-up may reuse memory the
            # warm-up freed and read slightly negative) and a percentage.
            int(row[mib_column])
            assert row[mib_column + 1].endswith("%")


def test_peak_rss_of_a_case_counts_what_the_call_allocates():
    # The naive baseline holds an fp32 log_softmax of the logits besides their
    # gradient: 4·n·v bytes beyond the gradient, resident at the peak.
    if not rss_measurable():
        pytest.skip("needs Linux's /proc/self/clear_refs")
    n, v = 512, 8192  # 16 MiB of logits
    case = {"n": n, "v": v, "dtype": "float32", "with_entropy": False, "peers": False}
    naive = peak_rss_bytes("rlmath.bench.logprobs", {**case, "impl": logprobs.BASE}, threads=1)
    ours = peak_rss_bytes("rlmath.bench.logprobs", {**case, "impl": "rlmath"}, threads=1)
    assert naive is not None and ours is not None
    assert naive >= 4 * n * v * 0.9
    assert ours < naive / 2


def test_table_headers_state_the_load(capsys):
    with session(busy_cores=1, threads=1, peers=False, rss=False) as setting:
        logprobs.run(setting, repeats=5, shapes=[(8, 50)], dtypes=["float32"])
    out = capsys.readouterr().out
    assert "1 thread, cpu;" in out and "load: 1 busy process, load average" in out


# ----------------------------------------------------------------------------- the baselines


def test_naive_log_probs_and_unfused_head_match_rlmath():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 50, generator=g) * 3
    labels = torch.randint(0, 50, (12,), generator=g)
    lp, ent = R.log_probs_and_entropy_from_logits(logits, labels)
    torch.testing.assert_close(baselines.naive_log_probs(logits, labels), lp)
    naive_lp, naive_ent = baselines.naive_log_probs_and_entropy(logits, labels)
    torch.testing.assert_close(naive_lp, lp)
    torch.testing.assert_close(naive_ent, ent)
    hidden, weight = torch.randn(12, 8, generator=g), torch.randn(50, 8, generator=g)
    fused_lp, fused_ent = log_probs_and_entropy_from_hidden(hidden, weight, labels)
    unfused_lp, unfused_ent = baselines.unfused_head(hidden, weight, labels)
    torch.testing.assert_close(unfused_lp, fused_lp)
    torch.testing.assert_close(unfused_ent, fused_ent)


needs_onednn = pytest.mark.skipif(
    not cpu_matmul.onednn_available(), reason="this torch build has no oneDNN"
)


@needs_onednn
def test_the_onednn_linear_of_the_baseline_within_the_rounding_bound():
    # Each of its three products is a k-term fp32 dot product: within γ_k of
    # the fp64 product of the same fp32 values (k = H, V, N in turn).
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 64, generator=g, requires_grad=True)
    weight = (torch.randn(300, 64, generator=g) * 0.2).requires_grad_()
    upstream = torch.randn(40, 300, generator=g)
    z = baselines._OnednnLinear.apply(hidden, weight)
    z.backward(upstream)
    h, w, up = hidden.detach().double(), weight.detach().double(), upstream.double()

    def within(got, exact, scale, k):
        u = 2.0**-24
        assert ((got.double() - exact).abs() <= k * u / (1 - k * u) * scale).all()

    within(z.detach(), h @ w.T, h.abs() @ w.abs().T, 64)
    within(hidden.grad, up @ w, up.abs() @ w.abs(), 300)
    within(weight.grad, up.T @ h, up.abs().T @ h.abs(), 40)


def test_unfused_head_onednn_is_rlmaths_log_probs_of_those_logits():
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(12, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (12,), generator=g)
    logits = baselines._OnednnLinear.apply(hidden, weight)
    expected = R.log_probs_and_entropy_from_logits(logits, labels)
    for a, b in zip(baselines.unfused_head_onednn(hidden, weight, labels), expected, strict=True):
        assert torch.equal(a, b)


def test_the_onednn_linear_of_the_baseline_passes_gradcheck():
    # fp64 runs torch's matmuls through the same forward and backward formulas.
    g = torch.Generator().manual_seed(5)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(baselines._OnednnLinear.apply, (h, w))
    w_frozen = w.detach()
    assert torch.autograd.gradcheck(lambda x: baselines._OnednnLinear.apply(x, w_frozen), (h,))


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
def test_gae_loop_matches_rlmath(gamma, lam):
    rewards, values, mask = gae_inputs(6, 64, seed=3)
    for whiten in (True, False):
        ours = R.compute_gae_advantage_return(rewards, values, mask, gamma, lam, whiten=whiten)
        loop = baselines.gae_loop(rewards, values, mask, gamma, lam, whiten=whiten)
        for a, b in zip(ours, loop):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


OURS = {
    "grpo": R.compute_grpo_outcome_advantage,
    "grpo_passk": R.compute_grpo_passk_outcome_advantage,
    "rloo": R.compute_rloo_outcome_advantage,
    "opo": R.compute_opo_outcome_advantage,
    "gpg": R.compute_gpg_outcome_advantage,
    "reinforce_plus_plus_baseline": R.compute_reinforce_plus_plus_baseline_outcome_advantage,
    "gdpo": R.compute_gdpo_outcome_advantage,
}


def test_every_outcome_loop_has_its_rlmath_estimator():
    assert set(baselines.OUTCOME_LOOPS) == set(OURS)


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("scores", ["0/1", "random"])
def test_outcome_loops_match_rlmath(name, scores):
    # 0/1 outcomes give tied and flat groups; random rewards give every group a spread.
    rewards, mask, index = outcome_inputs(96, 4, 12, seed=5)
    if scores == "random":
        rewards = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(6))
    index = torch.cat([index, torch.tensor([-1])])  # and one singleton group
    rewards, mask = torch.cat([rewards, rewards[:1]]), torch.cat([mask, mask[:1]])
    uids = [f"uid-{k}" for k in index.tolist()]
    ours = OURS[name](rewards, mask, index)
    for groups in (index, uids):
        loop = baselines.OUTCOME_LOOPS[name](rewards, mask, groups)
        for a, b in zip(ours, loop):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_grpo_torch_scalar_loop_matches_rlmath():
    rewards, mask, index = outcome_inputs(64, 4, 10, seed=7)
    ours, _ = R.compute_grpo_outcome_advantage(rewards, mask, index)
    loop = baselines.grpo_torch_scalar_loop(rewards, mask, index.tolist())
    torch.testing.assert_close(loop, ours, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- busy processes


def test_busy_processes_run_during_the_block_and_are_gone_after():
    with BusyLoad(K) as load:
        assert len(load.pids) == len(set(load.pids)) == K
        assert load.running() == K
        for pid in load.pids:
            os.kill(pid, 0)  # exists
    assert load.running() == 0
    assert all(_gone(p) for p in load.processes)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_busy_processes_are_ended_when_the_block_raises(error):
    with pytest.raises(error), BusyLoad(K) as load:
        assert load.running() == K
        raise error("stop")
    assert all(_gone(p) for p in load.processes)


def test_session_ends_its_busy_processes_when_the_run_raises():
    with pytest.raises(RuntimeError), session(busy_cores=K, peers=False) as setting:
        processes = setting.load.processes
        assert setting.load.running() == K
        raise RuntimeError("stop")
    assert all(_gone(p) for p in processes)


def test_zero_busy_cores_start_nothing():
    with BusyLoad(0) as load:
        assert load.pids == [] and load.running() == 0


def test_a_busy_process_ends_by_itself_after_its_time():
    with BusyLoad(1, max_seconds=0.2) as load:
        assert load.processes[0].wait(timeout=60) == 0


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_busy_process_ends_when_its_parent_is_killed():
    code = (
        "import sys, time\n"
        "from rlmath.bench.busy import BusyLoad\n"
        "load = BusyLoad(1).__enter__()\n"
        "print(load.pids[0], flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: no cleanup runs in the parent
        parent.wait()

    def ended() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        return state in ("Z", "X")  # a zombie has ended: only its reaping is left

    deadline = time.monotonic() + 60
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended()


@pytest.mark.parametrize("k", [-1, CORES + 1])
def test_busy_cores_out_of_range(k):
    with pytest.raises(ValueError, match=rf"busy_cores must be in \[0, {CORES}\]"):
        check_busy_cores(k)
    with pytest.raises(ValueError):
        BusyLoad(k)


def test_busy_cores_must_be_an_int():
    with pytest.raises(TypeError):
        check_busy_cores(True)
    with pytest.raises(TypeError):
        check_busy_cores(1.0)  # type: ignore[arg-type]


def test_session_restores_the_thread_count():
    before = torch.get_num_threads()
    with session(threads=1, peers=False):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_interleaved_rounds_rotate_the_order():
    from rlmath.bench.setting import interleaved

    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved(fns, torch.device("cpu"), 4, warmup=False, collect=False)
    assert set(times) == {"a", "b", "c"}
    rounds = ["".join(calls[i : i + 3]) for i in range(0, 12, 3)]
    # Each round runs every function once; each function follows each other one in turn.
    assert rounds == ["abc", "bca", "cab", "abc"]
