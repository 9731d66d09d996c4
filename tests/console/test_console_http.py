"""`ledger console` over real HTTP: read-only by construction (GET only, the log opened read-only and
left byte for byte as it was), the token by the agents' rules, loopback by default, a clean stop with
a page still open, bad input in one line, and the vendored front-end files as recorded."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Error as PlaywrightError

from console import ConsoleConfig, create_app
from eventstore import open_store, upgrade_database
from tests.console.browser import chromium
from tests.console.processes import ConsoleProcess, run
from tests.projections.builder import LogBuilder
from tests.projections.tamper import edit_data

pytestmark = [pytest.mark.slow]

# Far above what a check of a small log takes on a busy machine (a process is spawned for it).
CHECK_BOUND_S = 300.0
PATHS = (
    "/",
    "/overview",
    "/groups",
    "/groups/g1",
    "/rollouts/g1_g0",
    "/rollouts/g1_g0/swimlane",
    "/rollouts/g1_g0/tries/0/payloads",
    "/checkpoints",
    "/checkpoints/ck-1",
    "/steps",
    "/steps/0",
    "/audit",
    "/audit/status",
    "/audit/run?check=verify",
    "/events/1",
    "/static/htmx.min.js",
    "/health",
)


@pytest.fixture
def small_db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        log = LogBuilder(store)
        log.clean_sibling_group("g1", 2)
        log.claim("g1", 0)
        log.checkpoint("ck-1")
    finally:
        store.close()
    return url


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_console_only_reads(small_db: str, tmp_path: Path) -> None:
    """Every route answers GET; anything else is 405 before a route runs; the log file is opened
    read-only by the console's process and is the same byte for byte after every page was read."""
    db_file = tmp_path / "ledger.db"
    before = _sha(db_file)
    with (
        ConsoleProcess("--db", small_db) as console,
        httpx.Client(base_url=console.url.rstrip("/"), timeout=60, follow_redirects=True) as http,
    ):
        for path in PATHS:
            assert http.get(path).status_code == 200, path
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                refused = http.request(method, path, content=b"{}")
                assert refused.status_code == 405, (method, path)
                assert refused.headers["allow"] == "GET, HEAD"
        assert console.process is not None
        fds = Path(f"/proc/{console.process.pid}/fd")
        held = [fd for fd in fds.iterdir() if os.path.realpath(fd) == str(db_file.resolve())]
        assert held, "the console holds no descriptor on the log"
        for fd in held:
            found = re.search(r"flags:\s+(\d+)", (fds.parent / "fdinfo" / fd.name).read_text())
            assert found is not None
            flags = int(found.group(1), 8)
            assert flags & os.O_ACCMODE == os.O_RDONLY, f"fd {fd.name} on the log is open for writing"
    assert _sha(db_file) == before


def test_every_route_of_the_app_is_a_get(small_db: str) -> None:
    store = open_store(small_db, read_only=True)
    try:
        guard, _ = create_app(store, ConsoleConfig(url=small_db))
        routes = guard.app.router.routes  # type: ignore[attr-defined]
        methods = {m for r in routes for m in (getattr(r, "methods", None) or {"GET"})}
        assert methods <= {"GET", "HEAD"}, methods
    finally:
        store.close()


def test_the_token_guards_every_page_but_health(small_db: str, tmp_path: Path) -> None:
    token = "s3cret-token"
    with ConsoleProcess("--db", small_db, env={"LEDGER_CONSOLE_TOKEN": token}) as console:
        url = console.url.rstrip("/")
        basic = base64.b64encode(f"ops:{token}".encode()).decode()
        for headers, status in (
            ({}, 401),
            ({"authorization": f"Bearer {token}"}, 200),
            ({"authorization": f"Bearer {token}x"}, 401),
            ({"authorization": token}, 401),
            ({"authorization": f"Basic {basic}"}, 200),
            ({"authorization": "Basic " + base64.b64encode(b"ops:wrong").decode()}, 401),
            ({"authorization": "Basic !!!"}, 401),
        ):
            for path in ("/", "/groups", "/live", "/static/htmx.min.js", "/events/1"):
                if path == "/live" and status == 200:
                    continue  # a stream: opened by the browser below
                answer = httpx.get(url + path, headers=headers, timeout=60)
                assert answer.status_code == status, (headers, path)
                assert token not in answer.text
                if status == 401:
                    assert answer.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        # A browser sends the token as HTTP Basic's password, to the pages and the event stream alike.
        with chromium(http_credentials={"username": "ops", "password": token}) as ctx:
            page = ctx.new_page()
            page.goto(console.url)
            page.wait_for_selector("#groups-sealed")
            page.screenshot(path=str(tmp_path / "token.png"))
        with chromium() as ctx:
            page = ctx.new_page()
            # Asked for credentials it does not have, the browser shows no page of the console.
            with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(console.url)


def test_loopback_by_default_and_a_warning_without_a_token_elsewhere(small_db: str) -> None:
    with ConsoleProcess("--db", small_db) as console:
        assert console.url.startswith("http://127.0.0.1:")
    with ConsoleProcess("--db", small_db, "--host", "0.0.0.0") as console:
        assert "warning: listening on 0.0.0.0 without a token" in console.log()


def test_sigterm_stops_it_with_a_page_open(small_db: str) -> None:
    with ConsoleProcess("--db", small_db) as console, httpx.Client(timeout=60) as http:
        with http.stream("GET", console.url + "live") as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("retry:")
            assert any(line == "event: overview" for line in lines)
            status = console.stop()
        assert status == 0, console.log()


def test_bad_input_is_one_line(tmp_path: Path, small_db: str) -> None:
    for args, words in (
        (["--db", "mysql://u@h/x"], "error: "),
        (["--db", f"sqlite:///{tmp_path / 'nowhere.db'}"], "no log at"),
        (["--db", small_db, "--port", "70000"], "65535"),
    ):
        done = run("console", "--port", "0", *args, timeout=120)
        assert done.returncode == 2 and words in done.stderr, done
        assert "Traceback" not in done.stderr and done.stdout == ""
    with ConsoleProcess("--db", small_db) as console:
        port = console.url.rstrip("/").rsplit(":", 1)[1]
        taken = ConsoleProcess("--db", small_db)
        taken.args = ["console", "--port", port, "--db", small_db]
        with pytest.raises(AssertionError, match=r"cannot listen on 127\.0\.0\.1"):
            taken.start()
    assert not (tmp_path / "nowhere.db").exists()


def test_the_vendored_files_are_the_ones_recorded() -> None:
    static = Path(__file__).parents[2] / "console" / "static"
    table = (static / "VENDORED.md").read_text()
    for name, license_file in (("htmx.min.js", "LICENSE.htmx"), ("sse.min.js", "LICENSE.htmx-ext-sse")):
        assert f"`{name}`" in table and _sha(static / name) in table
        assert "Permission to use, copy, modify" in (static / license_file).read_text()
    templates = Path(__file__).parents[2] / "console" / "templates"
    for template in templates.iterdir():
        assert not re.search(r"(src|href)=\"(https?:)?//", template.read_text()), template.name


def test_the_checks_name_an_edited_row_and_link_to_it(small_db: str) -> None:
    """A row edited behind the append-only trigger's back: the audit run from the page names the
    broken hash chain there, and `replay --verify`'s check of the chain stops at it; both link to
    the row."""
    store = open_store(small_db, read_only=True)
    try:
        edited = next(e for e in store.read_all(0) if e.type == "AttemptMinted")
    finally:
        store.close()
    edit_data(small_db, edited.position, {**edited.data, "generation_index": 7})
    with (
        ConsoleProcess("--db", small_db) as console,
        httpx.Client(base_url=console.url.rstrip("/"), timeout=60) as http,
    ):
        for check, result in (("audit", "audit-result"), ("verify", "verify-result")):
            assert http.get(f"/audit/run?check={check}", headers={"hx-request": "true"}).status_code == 200
            deadline = time.monotonic() + CHECK_BOUND_S
            page = ""
            while f'id="{result}"' not in page:
                assert time.monotonic() < deadline, f"the {check} did not finish within {CHECK_BOUND_S} s"
                time.sleep(0.5)
                page = http.get("/audit/status").text
            section = page.split(f'id="{result}"', 1)[1].split("</section>", 1)[0]
            assert 'data-ok="false"' in section.split(">", 1)[0]
            assert f'href="/events/{edited.position}"' in section, section
        overview = http.get("/overview").text
        assert 'id="audit-verdict"' in overview and ">violations<" in overview
