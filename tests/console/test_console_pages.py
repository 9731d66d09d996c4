"""Every view of `ledger console` in headless Chromium, against a log made by `ledger simulate`: what a
person sees is what the other commands say (`ledger status --json`, `ledger show`, `ledger audit
--json`) and what the log and the payload store hold.  Each view is photographed (under the test's
temporary directory)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import BrowserContext, Page

from eventstore import open_store
from eventstore.events import LogprobsComputed, ReplacementMinted, SiblingSealed
from eventstore.payload_stores import payload_plane
from payloads.token_arrays import decode_payload
from tests.console.browser import chromium
from tests.console.processes import ConsoleProcess, ledger, status_json

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("console-browser")]


@pytest.fixture(scope="module")
def console(simulated: str) -> Iterator[ConsoleProcess]:
    with ConsoleProcess("--db", simulated) as process:
        yield process


@pytest.fixture(scope="module")
def browser() -> Iterator[BrowserContext]:
    with chromium() as ctx:
        yield ctx


@pytest.fixture
def page(browser: BrowserContext, console: ConsoleProcess) -> Iterator[Page]:
    tab = browser.new_page()
    outside: list[str] = []
    tab.on("request", lambda r: None if r.url.startswith(console.url) else outside.append(r.url))
    try:
        yield tab
    finally:
        tab.close()
    # Nothing is fetched from anywhere but the console itself (htmx is served from the package).
    assert not outside, outside


def _count(page: Page, selector: str) -> int:
    return int(page.locator(selector).get_attribute("data-count") or "-1")


def _shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def _overview_ready(page: Page) -> None:
    page.wait_for_selector("#groups-sealed")
    page.wait_for_function("() => !document.querySelector('#catching-up')")


def test_overview_shows_what_ledger_status_says(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    expected = status_json(simulated)
    page.goto(console.url)
    _overview_ready(page)
    for status in ("open", "sealed", "dead_lettered"):
        want = expected["groups"][status]["in_play"] + expected["groups"][status]["archived"]
        assert _count(page, f"#groups-{status}") == want, status
    claimed = expected["claimed"]["in_play"] + expected["claimed"]["archived"]
    assert claimed > 0 and _count(page, "#groups-claimed") == claimed
    assert int(page.locator("#log-head").get_attribute("data-position") or 0) == expected["head"]
    assert f"projection runner at {expected['projection_runner']:,}" in page.inner_text("#runner")
    last = expected["last_checkpoint"]
    assert last is not None
    # The current checkpoint's participants, each with its phase and prepare wait.
    rows = page.locator("#participants tr").all_inner_texts()
    assert len(rows) == 1 + len(last["prepare_wait_s"])
    thrown = expected["generation"]["thrown_by_checkpoints_share"] * 100
    assert page.inner_text("#thrown").strip() == f"{thrown:.2f} %"
    assert page.inner_text("#audit-verdict").strip() == "not run"
    _shot(page, tmp_path, "overview")


def test_groups_are_listed_filtered_paged_and_found(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    expected = status_json(simulated)
    every = sum(v["in_play"] + v["archived"] for v in expected["groups"].values())
    page.goto(console.url + "groups")
    assert _count(page, "#groups-total") == every
    assert page.locator("#groups tr[data-group]").count() == min(every, 50)
    page.select_option("select[name=status]", "sealed")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"status=sealed"))
    sealed = expected["groups"]["sealed"]["in_play"] + expected["groups"]["sealed"]["archived"]
    assert _count(page, "#groups-total") == sealed
    assert set(page.locator("#groups tr[data-group] .pill").all_inner_texts()) <= {"sealed"}
    # Claimed for train step 0: exactly one group (the run claims a step per group).
    page.goto(console.url + "groups?step=0")
    assert _count(page, "#groups-total") == 1
    # A bad filter is one sentence on the page, not an error page.
    page.goto(console.url + "groups?since=yesterday-ish")
    assert "is not a time" in page.inner_text("#filter-error")
    # Search by rollout id lands on the rollout; by group id on the group.
    some = page.goto(console.url + "groups")
    assert some is not None
    group_id = page.locator("#groups tr[data-group]").first.get_attribute("data-group") or ""
    page.fill("header input[name=q]", f"{group_id}_g1")
    page.click("header form.search button")
    page.wait_for_selector("#rollout-id")
    assert page.inner_text("#rollout-id") == f"{group_id}_g1"
    page.fill("header input[name=q]", group_id)
    page.click("header form.search button")
    page.wait_for_selector("#group-id")
    assert page.inner_text("#group-id") == group_id
    assert page.locator("#siblings tr").count() == 1 + 4
    _shot(page, tmp_path, "group")


def _replaced_rollout(db: str) -> tuple[str, list[int]]:
    """A rollout that took more than one try, and its tries, from the log."""
    store = open_store(db, read_only=True)
    try:
        tries: dict[str, set[int]] = {}
        for event in store.read_all(0, types=[ReplacementMinted.event_type()]):
            decoded = event.decode()
            assert isinstance(decoded, ReplacementMinted)
            tries.setdefault(decoded.rollout_id, {0}).add(decoded.attempt_index)
    finally:
        store.close()
    assert tries, "the simulated run replaced no try (its fault mix should have)"
    rollout_id = max(tries, key=lambda r: len(tries[r]))
    return rollout_id, sorted(tries[rollout_id])


def test_a_rollout_shows_the_tries_ledger_show_shows(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    rollout_id, tries = _replaced_rollout(simulated)
    shown = ledger("show", rollout_id, "--db", simulated)
    show_tries = sorted(int(n) for n in re.findall(r"try #(\d+)", shown))
    show_positions = sorted(int(p) for p in re.findall(r"(\d+)\s+(?:\d\d:\d\d:\d\d|-)\s+[A-Z]\w+", shown))
    assert show_tries == tries
    page.goto(f"{console.url}rollouts/{rollout_id}")
    attempts = [int(a or -1) for a in page.locator("#attempts tr[data-attempt]").evaluate_all(
        "rows => rows.map(r => r.dataset.attempt)")]  # fmt: skip
    assert attempts == show_tries
    positions = sorted(int(t) for t in page.locator("#events tr td:first-child").all_inner_texts())
    assert positions == show_positions
    # Each try says why it ended; a replaced one did not end sealed.
    ended = page.locator("#attempts td.ended").all_inner_texts()
    assert all(text.strip() for text in ended) and not ended[0].startswith("sealed")
    # The swimlane: one arrow per event; zooming redraws it on a linear time axis and the permalink keeps it.
    assert page.locator("#swimlane svg g.ev").count() >= len(show_positions)
    fitted = float(page.locator("#swimlane svg").get_attribute("height") or 0)
    page.click("#swimlane a[data-zoom='1000']")
    page.wait_for_selector("#swimlane .swimlane[data-zoom='1000']")
    assert page.url.endswith(f"rollouts/{rollout_id}?zoom=1000")
    assert float(page.locator("#swimlane svg").get_attribute("height") or 0) > fitted
    assert (page.get_attribute("#permalink", "href") or "").endswith("?zoom=1000")
    page.goto(page.url)  # the permalink opens the same view
    assert page.locator("#swimlane .swimlane").get_attribute("data-zoom") == "1000"
    _shot(page, tmp_path, "rollout")


def test_a_tries_payloads_are_decoded_through_the_checked_reads(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    """The sealed try's token ids and logprobs on the page are the stored records' own, beside the
    logprobs the worker computed; the reply's text is the stored reply's."""
    store = open_store(simulated, read_only=True)
    try:
        sealed = next(e.decode() for e in store.read_all(0, types=[SiblingSealed.event_type()]))
        assert isinstance(sealed, SiblingSealed)
        claim = sealed.receipt.tokens_claim()
        records = decode_payload(
            bytearray(payload_plane(store).get(claim)), claim.media_type, check_canonical=False
        )
        scored = [
            e.decode()
            for e in store.read_all(0, types=[LogprobsComputed.event_type()])
            if json.loads(e.data_json)["rollout_id"] == sealed.rollout_id
        ]
    finally:
        store.close()
    assert scored, "the worker scored no try of this rollout"
    page.goto(f"{console.url}rollouts/{sealed.rollout_id}#try-{sealed.attempt_index}")
    page.click(f"#payloads-{sealed.attempt_index} button.decode")
    decoded = page.locator(f".decoded[data-attempt='{sealed.attempt_index}']")
    decoded.wait_for()
    ids = [int(t) for t in decoded.locator(".token-table tr td:nth-child(2)").all_inner_texts()]
    expected = [int(t) for r in range(len(records)) for t in records.generation(r)]
    assert ids == expected[: len(ids)] and ids
    agent = [float(t) for t in decoded.locator(".token-table tr td:nth-child(3)").all_inner_texts()]
    assert agent[0] == pytest.approx(float(records.logprobs(0)[0]), abs=1e-6)
    worker = decoded.locator(".token-table tr td:nth-child(4)").all_inner_texts()
    assert all(w != "-" for w in worker)
    text = decoded.locator("pre.text").first.inner_text()
    assert text and text in decoded.locator("pre.reply").inner_text()
    _shot(page, tmp_path, "payloads")


def test_checkpoints_show_their_cut_waits_and_blockers(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    expected = status_json(simulated)
    page.goto(console.url + "checkpoints")
    assert page.locator("#checkpoints tr[data-checkpoint]").count() == min(
        50, sum(expected["checkpoints"].values())
    )
    last = expected["last_checkpoint"]
    page.click(f"#checkpoints a:text-is('{last['checkpoint_id']}')")
    page.wait_for_selector("#checkpoint-id")
    assert page.inner_text("#checkpoint-status") == last["status"]
    assert page.inner_text("#cut").startswith(f"{last['cut_position']:,}")
    agents = page.locator("#participants tr td:first-child").all_inner_texts()
    assert sorted(agents) == sorted(last["prepare_wait_s"])
    _shot(page, tmp_path, "checkpoint")


def test_a_train_steps_samples_and_their_digests(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    page.goto(console.url + "steps")
    page.click("#steps a:text-is('0')")
    page.wait_for_selector("#step")
    assert _count(page, "#step-groups") == 1
    group_id = page.locator("section[data-group]").get_attribute("data-group") or ""
    digests = set(page.locator("table.samples td.mono:nth-child(5)").all_inner_texts())
    store = open_store(simulated, read_only=True)
    try:
        sealed = {
            e.decode().receipt.tokens_digest  # type: ignore[attr-defined]
            for e in store.read_stream(f"group-{group_id}")
            if e.type == SiblingSealed.event_type()
        }
    finally:
        store.close()
    assert digests == sealed and len(sealed) == 4
    _shot(page, tmp_path, "step")


def test_the_audit_and_verify_run_from_the_page(
    page: Page, console: ConsoleProcess, simulated: str, tmp_path: Path
) -> None:
    report = json.loads(ledger("audit", "--db", simulated, "--json"))
    page.goto(console.url + "audit")
    page.click("#run-audit")
    result = page.locator("#audit-result")
    result.wait_for()
    assert result.get_attribute("data-ok") == "true"
    assert result.inner_text().startswith(
        f"{report['events']:,} events, {len(report['rules_checked'])} rules: clean"
    )
    page.click("#run-verify")
    verify = page.locator("#verify-result")
    verify.wait_for()
    assert verify.get_attribute("data-ok") == "true"
    assert "rebuilds agree" in verify.inner_text() and "hash chain verifies" in verify.inner_text()
    # The overview shows the audit's verdict.
    page.goto(console.url)
    assert page.inner_text("#audit-verdict").strip() == "clean"
    _shot(page, tmp_path, "audit")
