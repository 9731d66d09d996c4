"""The README stays the front door: short enough to read (at most 15,000 characters, the detail in
docs/), and every page it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CHARS = 15_000


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= MAX_CHARS, (
        f"README.md is {len(text)} characters (at most {MAX_CHARS}): move detail to docs/"
    )
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert "docs/cli.md" in links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
