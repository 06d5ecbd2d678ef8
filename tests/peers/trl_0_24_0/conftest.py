"""TRL 0.24's own tests of ``selective_log_softmax``/``entropy_from_logits``, run against rlmath.compat.trl.

The fp16/bf16 cases assert TRL's output dtype (``torch.equal`` with a bf16
``log_softmax``; ``assert_close`` against a half-precision entropy), while
rlmath.compat.trl deliberately returns fp32 for half-precision logits
(documented in the module and in ``docs/migration.md``). They are
``xfail(strict=True)``: a half case that passes would mean the documented
difference is gone. ``parameterized.expand`` numbers the cases in the order of
the parameter lists in the test file: entropy 0-7 fp64, 8-15 fp32, 16-23 fp16,
24-31 bf16; selective_log_softmax 0 fp64, 1 fp32, 2 fp16, 3 bf16.
"""

from __future__ import annotations

import pytest

_HALF = (
    "half-precision case: TRL returns the logits' dtype, rlmath.compat.trl returns fp32 "
    "(deliberate: computed in fp32 chunk by chunk)"
)

EXPECTED_FAILURES: dict[str, str] = {
    **{f"TestEntropyFromLogits::test_entropy_from_logits_2_dims_{i}": _HALF for i in range(16, 32)},
    **{f"TestSelectiveLogSoftmax::test_selective_log_softmax_{i}": _HALF for i in (2, 3)},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        key = item.nodeid.split("::", 1)[-1]
        reason = EXPECTED_FAILURES.get(key)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
