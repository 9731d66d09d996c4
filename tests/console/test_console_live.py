"""The overview changes as runs append, without the page being reloaded (server-sent events from
the console's subscription), on SQLite and on PostgreSQL; on PostgreSQL the console connects as the
auditor role (`LEDGER_AUDITOR_DB`, SELECT only), as an operator would run it.  Once the run is over,
the page shows what `ledger status --json` says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from playwright.sync_api import Page
from sqlalchemy.engine import make_url

from tests.console.browser import WAIT_MS, chromium
from tests.console.processes import LEDGER, ROOT, ConsoleProcess, ledger, status_json

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("console-browser")]

# Far above what the run takes on a busy machine; reached only if it hangs.
RUN_BOUND_S = 600.0


def _count(page: Page, selector: str) -> int:
    return int(page.locator(selector).get_attribute("data-count") or "-1")


def _run_to_the_end(db: str) -> None:
    """One `ledger simulate` on `db`, to its end.  Each model call lasts 1 s and the first checkpoint
    starts at 0.2 s: the run cannot end before it, however fast the machine (a run over before its
    first checkpoint has none)."""
    paced = ["--checkpoint-every", "0.2", "--call-seconds", "1"]
    run = subprocess.run(
        [*LEDGER, "simulate", "--db", db, "--groups", "3", "--agents", "2", *paced],
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_overview_follows_a_run_as_it_appends(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        db = f"sqlite:///{tmp_path / 'ledger.db'}"
        ledger("db", "upgrade", "--db", db)
        console_args, console_env = ["--db", db], {}
    else:
        db = str(request.getfixturevalue("pg_url"))
        ledger("db", "upgrade", "--db", db)
        ledger("db", "roles", "--db", db, "--writer-password", "wpw", "--auditor-password", "apw")
        auditor = (
            make_url(db).set(username="ledger_auditor", password="apw").render_as_string(hide_password=False)
        )
        console_args, console_env = [], {"LEDGER_AUDITOR_DB": auditor}
    with ConsoleProcess(*console_args, env=console_env) as console, chromium() as ctx:
        page = ctx.new_page()
        page.goto(console.url)
        page.wait_for_selector("#groups-sealed")
        assert _count(page, "#groups-sealed") == 0
        # A mark a reload would wipe: the changes below must reach this very page.
        page.evaluate("() => { window.__same_page = true }")
        # Two runs, one after the other: the page must follow the second one's appends after it
        # showed the first one whole, a gate that holds however slow the console's updates are (a
        # page that first heard of a seal once a single run was over proved nothing).
        shown = []
        for _ in range(2):
            _run_to_the_end(db)
            head = status_json(db)["head"]
            page.wait_for_function(
                f"() => Number(document.querySelector('#log-head').dataset.position) === {head}",
                timeout=WAIT_MS,
            )
            assert _count(page, "#groups-sealed") > 0
            shown.append(head)
        expected = status_json(db)
        assert expected["head"] == shown[1] > shown[0] > 0
        assert page.evaluate("() => window.__same_page === true")
        for status in ("open", "sealed", "dead_lettered"):
            want = expected["groups"][status]["in_play"] + expected["groups"][status]["archived"]
            assert _count(page, f"#groups-{status}") == want, status
        assert (
            _count(page, "#groups-claimed")
            == expected["claimed"]["in_play"] + expected["claimed"]["archived"]
        )
        # The run decided every checkpoint it started: the current one is not left preparing.
        assert page.inner_text("#checkpoint-status") != "preparing"
        page.screenshot(path=str(tmp_path / f"live-{backend}.png"), full_page=True)
