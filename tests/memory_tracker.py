"""The allocation tracker the memory tests use: :mod:`rlmath.bench.memory`, re-exported.

The tracker lives in the package so that ``rlmath bench`` reports the same
deterministic peaks that the tests assert; see that module for how it counts.
"""

from __future__ import annotations

from rlmath.bench.memory import Allocation, MemoryTracker

__all__ = ["Allocation", "MemoryTracker"]
