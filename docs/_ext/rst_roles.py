"""A griffe extension for the API reference: rlmath's docstrings rendered as Markdown.

Two habits of rlmath's docstrings are not Google-style Markdown, and each is
rewritten before the docstring is parsed:

* Sphinx roles (``:func:`agg_loss```, ``:class:`~rlmath.engine.VocabShard```)
  become inline code: the target as written, or its last component after a
  ``~``.
* An ``Args:`` entry that documents several parameters at once
  (``clip_ratio_low, clip_ratio_high: ...``) becomes one entry per parameter,
  each with the shared description.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|meth|attr|exc|obj|const):`(~?)([^`]+)`")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Other Parameters):\s*$")
_GROUP = re.compile(r"^(\s+)(\**\w+(?:\s*,\s*\**\w+)+):\s*(.*)$")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_grouped_args(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    section_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        header = _SECTION.match(line)
        if header:
            section_indent = len(header.group(1))
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip() and _indent(line) <= section_indent:
            section_indent = None
        group = _GROUP.match(line) if section_indent is not None else None
        if group is None:
            out.append(line)
            i += 1
            continue
        indent, names, desc = group.groups()
        i += 1
        rest: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            rest.append(lines[i])
            i += 1
        if not desc and rest:
            desc, rest = rest[0].strip(), rest[1:]
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{indent}{name}: {desc}")
            out.extend(rest)
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Apply both rewrites to every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = _ROLE.sub(_code, obj.docstring.value)
            obj.docstring.value = _split_grouped_args(value)
