"""The GPU compile check's readers of compiled code, on hand-written PTX and ``ptxas`` logs.

The check itself (``make test-gpu-compile``) needs triton; these parts are
plain text processing and run everywhere.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET"):
    pytest.skip(
        "the GPU compile check refuses to run under the interpreter", allow_module_level=True
    )

from tests.engine.triton_gpu_check import access_widths, occupancy, ptxas_figures, streams

_PTX = """
	.file	1 "/src/rlmath/engine/triton_backend/row_math.py"
	.file	2 "/src/rlmath/engine/triton_backend/logits_forward.py"
	.loc	2 57 17
	ld.global.b64 	%rd5, [%rd4+0];
	.loc	1 66 12
	@%p1 ld.global.v4.b32 	{ %r1, %r2, %r3, %r4 }, [ %rd7 + 0 ];
	@%p2 ld.global.v4.b32 	{ %r5, %r6, %r7, %r8 }, [ %rd8 + 0 ];
	.loc	1 133 40, function_name $L__info_string0, inlined_at 2 61 15
	ld.global.b64 	%rd9, [%rd10+0];
	ld.global.b32 	%r9, [%rd11+0];
	.loc	2 80 9
	@%p3 ld.global.b16 	%rs1, [ %rd12 + 0 ];
	@%p3 ld.global.b16 	%rs2, [ %rd13 + 0 ];
	@%p4 st.global.b32 	[ %rd14 + 0 ], %r10;
"""


def test_access_widths_by_source_line_and_row_streams():
    w = access_widths(_PTX)
    assert w["ld row_math.py:66"]["widths"] == {128: 2}
    assert w["ld row_math.py:133"]["widths"] == {64: 1, 32: 1}
    assert w["ld logits_forward.py:80"]["widths"] == {16: 2}
    assert w["st logits_forward.py:80"]["widths"] == {32: 1}
    s = streams(w)
    # A vector access or several accesses of one width make a row stream; two scalar loads
    # of different widths on one line (a label and its weight) do not, nor does one scalar.
    assert set(s) == {"ld row_math.py:66", "ld logits_forward.py:80"}
    assert min(s["ld logits_forward.py:80"]) < 128 <= min(s["ld row_math.py:66"])


def test_ptxas_figures():
    log = (
        "ptxas info    : Used 76 registers, used 1 barriers, 64 bytes smem\n"
        "ptxas info    : 8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
    )
    assert ptxas_figures(log) == {"registers": 76, "spill_stores": 4, "spill_loads": 4, "stack": 8}
    assert ptxas_figures("ptxas info : Used 32 registers")["spill_stores"] == 0


def test_occupancy_from_registers_warps_and_shared_memory():
    # sm_90: 65536 registers, 64 warps. 64 registers x 16 warps: 2 programs, 32 warps.
    assert occupancy(90, 64, 64, 16) == 0.5
    assert occupancy(90, 76, 64, 16) == 0.25  # one register over: one program
    assert occupancy(90, 32, 0, 8) == 1.0
    assert occupancy(90, 32, 100 * 1024, 8) == 2 * 8 / 64  # shared memory bound
