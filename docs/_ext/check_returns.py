"""Fail when a ``Returns:`` section of the API reference would be rendered garbled.

mkdocstrings renders each docstring through griffe's Google-style parser with
the options in mkdocs.yml. A ``Returns:`` section parsed into several items
(e.g. one sentence wrapped over several lines, each line made an item with a
type of its own) or into an item whose type is not a Python expression is
shown as a table of nonsense rows. This script parses every public docstring
of ``rlmath`` the way the site does and lists each such section.

Run: ``python docs/_ext/check_returns.py`` from the repository root (needs
griffe and PyYAML: the docs environment, docs/requirements.txt); exit status
1 when a section is garbled.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe
import yaml

ROOT = Path(__file__).resolve().parents[2]


class _Loader(yaml.SafeLoader):
    """mkdocs.yml may hold ``!!python/name:`` tags: read them as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def handler_options() -> dict[str, Any]:
    """The mkdocstrings python handler's options from mkdocs.yml."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return dict(plugin["mkdocstrings"]["handlers"]["python"]["options"])
    raise RuntimeError("mkdocs.yml configures no mkdocstrings python handler")


def _public(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if isinstance(member, griffe.Object):
            yield from _public(member)


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def garbled_returns(package: str = "rlmath", search_path: Path = ROOT / "src") -> list[str]:
    """``path: reason`` for each public object whose Returns section would render garbled."""
    options = handler_options()
    parser_options = dict(options.get("docstring_options", {}))
    extensions = griffe.load_extensions(*[str(ROOT / e) for e in options.get("extensions", [])])
    module = griffe.load(
        package,
        search_paths=[str(search_path)],
        docstring_parser=griffe.Parser(options.get("docstring_style", "google")),
        docstring_options=parser_options,
        extensions=extensions,
        resolve_aliases=False,
    )
    problems = []
    for obj in _public(module):
        if obj.docstring is None:
            continue
        for section in obj.docstring.parsed:
            if section.kind is not griffe.DocstringSectionKind.returns:
                continue
            items = list(section.value)
            if len(items) > 1:
                first = " / ".join(str(i.description)[:40].replace("\n", " ") for i in items[:3])
                problems.append(f"{obj.path}: {len(items)} return items ({first} ...)")
                continue
            for item in items:
                annotation = item.annotation
                if isinstance(annotation, str) and not _is_expression(annotation):
                    problems.append(f"{obj.path}: return type {annotation!r} is not a type")
    return problems


def main() -> int:
    problems = garbled_returns()
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} garbled Returns section(s)", file=sys.stderr)
        return 1
    print("every Returns section parses into one item")
    return 0


if __name__ == "__main__":
    sys.exit(main())
