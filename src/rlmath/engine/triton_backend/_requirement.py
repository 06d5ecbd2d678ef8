"""The Triton the kernels need: importing this module raises ``ImportError`` without it.

The registry reports the backend unavailable with the error's message, so a
machine without triton, or with one older than the oldest tested release,
falls back to the pure-torch backend under ``backend="auto"``.
"""

from __future__ import annotations

try:
    import triton
    import triton.language  # the kernels need the language module
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the 'triton' backend needs the triton package, which is not importable here "
        f"({exc}); install it with `pip install 'triton>=3.4'` (rlmath's `triton` extra) on a machine with a "
        "CUDA GPU, or use backend='torch'"
    ) from exc

__all__ = ["MIN_TRITON"]

MIN_TRITON = (3, 4)
"""The oldest Triton release the kernels are tested with; older ones lack
language features they use (triton 3.2 and 3.3, which torch 2.6 and 2.7 ship)."""


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.4.0"`` or ``"3.5.0+git1a2b"``."""
    numbers = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    major, minor = [*numbers, 0, 0][:2]
    return major, minor


if release(triton.__version__) < MIN_TRITON:
    raise ImportError(
        f"the 'triton' backend needs triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]}, but triton "
        f"{triton.__version__} is installed; upgrade it (`pip install -U 'triton>=3.4'`) "
        "or use backend='torch'"
    )
