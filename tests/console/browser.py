"""Debian's headless Chromium, driven by Playwright for Python (never a browser Playwright downloads)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from playwright.sync_api import BrowserContext, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# What a page may take at most to show what the test waits for (a busy 2-core machine is slow).
WAIT_MS = 60_000


@contextmanager
def chromium(**context: Any) -> Iterator[BrowserContext]:
    """A fresh browser profile each time (its own user-data-dir), closed on exit."""
    assert CHROMIUM.exists(), (
        f"{CHROMIUM} is not installed: these tests drive Debian's chromium (apt-get install -y chromium)"
    )
    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="console-chromium-") as profile:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=ARGS,
            viewport={"width": 1400, "height": 900},
            **context,
        )
        ctx.set_default_timeout(WAIT_MS)
        try:
            yield ctx
        finally:
            ctx.close()
