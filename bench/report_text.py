"""The report's prose: named blocks of ``bench/report_template.md``, filled with figures computed by the code.

A block starts at a line ``<!-- name -->`` and runs to the next one; its
placeholders are :class:`string.Template` names (``${cores}``). A value that
is a list of lines (a table) is joined with newlines.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Sequence
from pathlib import Path

TEMPLATE = Path(__file__).with_name("report_template.md")
_BLOCK = re.compile(r"^<!-- ([a-z0-9_.]+) -->$", re.MULTILINE)


@functools.cache
def blocks(path: Path = TEMPLATE) -> dict[str, str]:
    """Block name -> its text (surrounding blank lines dropped)."""
    parts = _BLOCK.split(path.read_text())
    return {name: body.strip("\n") for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def fill(name: str, **values: object) -> str:
    """Block ``name`` with its placeholders filled; every placeholder must have a value."""
    shown = {
        k: "\n".join(v) if isinstance(v, Sequence) and not isinstance(v, str) else str(v) for k, v in values.items()
    }
    return string.Template(blocks()[name]).substitute(shown)
