"""The overview changes while a run appends, without the page being reloaded (server-sent events from
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
        # Each model call lasts 1 s and the first checkpoint starts at 0.2 s: the run cannot end
        # before it, however fast the machine (a run over before its first checkpoint has none).
        paced = ["--checkpoint-every", "0.2", "--call-seconds", "1"]
        run = subprocess.Popen(
            [*LEDGER, "simulate", "--db", db, "--groups", "6", "--agents", "2", *paced],
            cwd=ROOT,
            env=os.environ.copy(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            # The gate: the run's first seal, shown on the open page.
            page.wait_for_function(
                "() => Number(document.querySelector('#groups-sealed').dataset.count) > 0",
                timeout=RUN_BOUND_S * 1000,
            )
            during = int(page.locator("#log-head").get_attribute("data-position") or 0)
            out, _ = run.communicate(timeout=RUN_BOUND_S)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        assert run.returncode == 0, out
        expected = status_json(db)
        page.wait_for_function(
            f"() => Number(document.querySelector('#log-head').dataset.position) === {expected['head']}",
            timeout=WAIT_MS,
        )
        assert expected["head"] > during > 0
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
