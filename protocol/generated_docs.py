"""Sections of docs/ drawn from the code (a diagram, a table) and kept current by a test: the one
way each such section is found, replaced and written by its `python -m ... [--write]` command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def with_section(doc: str, begin: str, end: str, generated: str) -> str:
    """`doc` with its text from the `begin` marker through the `end` marker replaced by `generated`
    (which holds both markers); ValueError when `doc` lacks either."""
    head, found_begin, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the document has no generated section between {begin!r} and {end!r}")
    return head + generated + tail


def section_main(
    argv: list[str], doc: Path, generated: Callable[[], str], with_generated: Callable[[str], str], name: str
) -> int:
    """The command of one generated section: prints it, or with `--write` writes it into `doc`."""
    if argv == ["--write"]:
        doc.write_text(with_generated(doc.read_text()))
        return 0
    if argv:
        print(f"usage: python -m {name} [--write]", file=sys.stderr)
        return 2
    print(generated())
    return 0
