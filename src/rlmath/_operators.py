"""rlmath's ``torch.library`` operators, and the Python body each one runs.

Every pass over the vocabulary (and the GAE scan) is registered with
:func:`operator`, which is ``torch.library.custom_op`` plus a record of the
undecorated function. A ``TorchDispatchMode`` sees an operator as one op and
its outputs: the ops inside it run with the mode switched off. A mode that must
see them, such as the allocation tracker of the benchmarks and the tests
(:class:`rlmath.bench.memory.MemoryTracker`, which counts the scratch buffers
of a pass), runs the body itself with :func:`python_body`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.library import custom_op

__all__ = ["operator", "python_body"]

F = TypeVar("F", bound=Callable[..., Any])

_BODIES: dict[str, Callable[..., Any]] = {}


def operator(name: str) -> Callable[[F], Any]:
    """``torch.library.custom_op(name, mutates_args=())``, remembering the function it wraps."""

    def register(fn: F) -> Any:
        _BODIES[name] = fn
        return custom_op(name, mutates_args=())(fn)

    return register


def python_body(op: object) -> Callable[..., Any] | None:
    """The Python function an rlmath operator overload runs, or ``None`` for any other op."""
    name = getattr(op, "name", None)
    if not callable(name):
        return None
    return _BODIES.get(name())
