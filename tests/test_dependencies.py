"""What the library imports when it is imported is what pyproject.toml declares.

A module-level import of a package that ``pip install rlmath`` does not
install would make ``import rlmath`` fail on a clean machine; optional
packages (matplotlib, tqdm, transformers, triton, numpy) are imported inside
functions or ``try`` blocks, where their absence is handled.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
#: Third-party packages ``pip install rlmath`` installs (pyproject.toml's dependencies).
DECLARED = {"torch"}
OURS = {"rlmath", "_rlmath_cli"}
#: Subpackages imported only when their extra is installed, and the package they need.
BEHIND_AN_EXTRA = {"rlmath/engine/triton_backend": "triton"}

if not SRC.is_dir():
    pytest.skip("src/ is not beside tests/ (an installed copy)", allow_module_level=True)


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """Top-level names imported unconditionally (not inside a function, ``if`` or ``try``)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_module_level_imports_are_declared_dependencies():
    undeclared = []
    for path in sorted(SRC.rglob("*.py")):
        for line, name in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name in sys.stdlib_module_names or name in OURS or name == "__future__":
                continue
            extra = [
                pkg
                for sub, pkg in BEHIND_AN_EXTRA.items()
                if str(path.relative_to(SRC)).startswith(sub)
            ]
            if name not in DECLARED and name not in extra:
                undeclared.append(f"{path.relative_to(SRC)}:{line}: {name}")
    assert not undeclared, undeclared


def test_typing_extensions_only_where_python_lacks_it():
    """``typing_extensions`` is declared for Python < 3.11 only: imported nowhere else."""
    users = [
        str(p.relative_to(SRC))
        for p in sorted(SRC.rglob("*.py"))
        if "typing_extensions" in p.read_text(encoding="utf-8")
    ]
    assert users == ["rlmath/_typing.py"]
    text = (SRC.parent / "pyproject.toml").read_text(encoding="utf-8")
    assert "\"typing_extensions>=4.1; python_version < '3.11'\"" in text
