"""The documentation points at things that exist: test names, files and links.

docs/design.md cites the test that shows each deliberate difference from verl
(``tests/...py::test_name``); a renamed or moved test must take its citation
along. Relative links in the Markdown pages must resolve inside the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    p
    for p in [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        ROOT / "tests" / "peers" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
    if p.exists()
)
CITATION = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
LINK = re.compile(r"\]\(([^)\s]+)\)")

if not (ROOT / "docs").is_dir():
    pytest.skip("docs/ is not beside tests/ (an installed copy)", allow_module_level=True)


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_tests_exist(page):
    missing = []
    for path, name in CITATION.findall(page.read_text(encoding="utf-8")):
        target = ROOT / path
        if not target.is_file():
            missing.append(path)
        elif name and name not in _functions(target):
            missing.append(f"{path}::{name}")
    assert not missing, f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL or an anchor on the same page
        target = (page.parent / link.split("#", 1)[0]).resolve()
        if not target.exists() or ROOT not in target.parents:
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
