"""The ``rlmath`` console script.

``import rlmath`` imports torch, which takes seconds; this module lives
outside the package so that ``rlmath --version`` answers from
``rlmath/_version.py`` alone, without importing rlmath or torch. Every other
command is handed to :func:`rlmath.cli.main`, with the time this process
started its work (so that the demo's wall time includes the imports).
"""

from __future__ import annotations

import time

_STARTED = time.time()

import importlib.util  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

__all__ = ["main", "version"]


def version() -> str:
    """``rlmath.__version__``, read from ``rlmath/_version.py`` without importing rlmath."""
    spec = importlib.util.find_spec("rlmath")  # a top-level name: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("rlmath is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "_version.py"
    loaded = importlib.util.spec_from_file_location("_rlmath_version", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return str(module.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlmath`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--version"]:
        print(f"rlmath {version()}")
        return 0
    # torch warns "Failed to initialize NumPy" when it is imported without
    # numpy installed (a plain `pip install rlmath`); rlmath does not need
    # numpy, so the warning would only alarm the user.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from rlmath.cli import main as cli_main

    return cli_main(args, started=_STARTED)
