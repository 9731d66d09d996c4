"""Markup and script in everything a log can carry as text (prompt references, failure and abort
reasons, an operator's reason, a reply's text, a token record's text) and in every id a URL can
carry: the console shows each as text, and nothing of it runs.  In headless Chromium, against a log
written through the store's own API (ids cannot carry markup: the log refuses them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from playwright.sync_api import BrowserContext, Dialog, Page

from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import (
    AckOwed,
    AckRejected,
    AttemptMinted,
    CheckpointAborted,
    CheckpointPrepareStarted,
    GroupClaimedForTraining,
    GroupReserved,
    GroupSealed,
    OperatorMark,
    PromptRef,
    ReceiptFetched,
    RolloutReceipt,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingSealed,
)
from eventstore.payload_stores import payload_plane
from payloads.replies import REPLY_MEDIA_TYPE
from protocol.digests import canonical_bytes
from protocol.ids import capture_key
from protocol.streams import checkpoint_stream, group_stream, operator_stream
from protocol.token_codec import TOKENS_MEDIA_TYPE, encode_records
from protocol.wire import AttemptRef, CompletionReceipt
from tests.console.browser import chromium
from tests.console.processes import ConsoleProcess

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("console-browser")]

# Each would set window.__pwned (or open a dialog) if it ran as markup.
HOSTILE = (
    '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
    "<svg onload=alert(3)></svg>\"'&amp;</textarea></pre>{{7*7}}"
)
GROUP = "evil"
ROLLOUT = f"{GROUP}_g0"
AGENT = "agent-0"


def _hostile_log(store: EventStore) -> None:
    plane = payload_plane(store)
    key = capture_key(ROLLOUT, 0)
    reply = {
        "response": {"output": [{"type": "message", "content": [{"type": "output_text", "text": HOSTILE}]}]},
        "reward": 1.0,
    }
    reply_bytes = canonical_bytes(reply)
    records = [
        {
            "rollout_id": key,
            "model_call_id": f"{key}-call-1",
            "prompt_token_ids": [1, 2, 3],
            "generation_token_ids": [7, 8],
            "generation_log_probs": [-0.5, -1.25],
            "output_items": [{"type": "message", "content": [{"type": "output_text", "text": HOSTILE}]}],
        }
    ]
    reply_claim, tokens_claim = plane.put(
        [(reply_bytes, REPLY_MEDIA_TYPE), (encode_records(records), TOKENS_MEDIA_TYPE)]
    )
    receipt = CompletionReceipt(
        rollout_id=ROLLOUT,
        attempt_index=0,
        execution_generation=1,
        result_identity=f"{key}#1",
        result_digest=reply_claim.digest,
        manifest_capture_key=key,
        terminal_model_call_id=f"{key}-call-1",
    )
    rollout_receipt = RolloutReceipt(
        rollout_id=ROLLOUT,
        attempt_index=0,
        capture_key=key,
        model_call_ids=[f"{key}-call-1"],
        terminal_model_call_id=f"{key}-call-1",
        token_count=2,
        tokens_digest=tokens_claim.digest,
        reward=1.0,
        mask_sample=False,
        tokens=tokens_claim,
    )
    stream = group_stream(GROUP)
    store.append(
        stream,
        [
            GroupReserved(
                group_id=GROUP,
                prompt_ref=PromptRef(sample_id=HOSTILE, task_name=HOSTILE),
                agent_name=AGENT,
                expected_generations=2,
                mode="sibling",
                payload={"prompt": HOSTILE},
            ),
            AttemptMinted(rollout_id=ROLLOUT, generation_index=0),
            AttemptMinted(rollout_id=f"{GROUP}_g1", generation_index=1),
            RunDispatched(rollout_id=ROLLOUT, attempt_index=0, capture_key=key, agent_name=AGENT),
            RunReplied(
                rollout_id=ROLLOUT,
                attempt_index=0,
                reward=1.0,
                mask_sample=False,
                reply_digest=reply_claim.digest,
                reply=reply_claim,
            ),
            ReceiptFetched(agent_name=AGENT, receipt=receipt),
            SiblingSealed(rollout_id=ROLLOUT, attempt_index=0, reward=1.0, receipt=rollout_receipt),
            AckOwed(agent_name=AGENT, receipt=receipt),
            RunDispatched(
                rollout_id=f"{GROUP}_g1",
                attempt_index=0,
                capture_key=capture_key(f"{GROUP}_g1", 0),
                agent_name=AGENT,
            ),
            RunFailed(rollout_id=f"{GROUP}_g1", attempt_index=0, reason=HOSTILE, kind="env"),
        ],
    )
    store.append(
        operator_stream(AGENT),
        [
            AckRejected(
                rollout_id=ROLLOUT,
                attempt_index=0,
                error="dropped_by_operator",
                operator=OperatorMark(operator=HOSTILE, reason=HOSTILE),
            )
        ],
    )
    store.append(
        stream, [GroupSealed(group_id=GROUP, attempts=[AttemptRef(rollout_id=ROLLOUT, attempt_index=0)])]
    )
    store.append(stream, [GroupClaimedForTraining(group_id=GROUP, train_step=3)])
    checkpoint = checkpoint_stream("ck-1")
    store.append(checkpoint, [CheckpointPrepareStarted(checkpoint_id="ck-1", participants=[AGENT])])
    store.append(checkpoint, [CheckpointAborted(checkpoint_id="ck-1", participants=[AGENT], reason=HOSTILE)])


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('hostile') / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        _hostile_log(store)
    finally:
        store.close()
    return url


@pytest.fixture(scope="module")
def console(hostile_db: str) -> Iterator[ConsoleProcess]:
    with ConsoleProcess("--db", hostile_db) as process:
        yield process


@pytest.fixture(scope="module")
def browser() -> Iterator[BrowserContext]:
    with chromium() as ctx:
        yield ctx


def _visit(browser: BrowserContext, url: str, tmp_path: Path, name: str, then: str | None = None) -> Page:
    page = browser.new_page()
    dialogs: list[str] = []

    def dismiss(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", dismiss)
    page.goto(url)
    if then is not None:
        page.click(then)
        page.wait_for_selector(".decoded")
    page.wait_for_load_state("networkidle")
    assert page.evaluate("() => window.__pwned === undefined"), f"markup ran on {url}"
    assert not dialogs, dialogs
    # The only scripts are the console's own two (htmx and its SSE extension).
    assert page.locator("script").evaluate_all("s => s.map(x => x.getAttribute('src'))") == [
        "/static/htmx.min.js",
        "/static/sse.min.js",
    ]
    assert page.locator("img, iframe, textarea, [onload], [onerror]").count() == 0
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    return page


def test_text_from_the_log_is_shown_as_text(
    browser: BrowserContext, console: ConsoleProcess, tmp_path: Path
) -> None:
    page = _visit(
        browser, f"{console.url}rollouts/{ROLLOUT}", tmp_path, "rollout", then="#payloads-0 button.decode"
    )
    assert HOSTILE in page.inner_text("#prompt")
    assert HOSTILE in page.locator("pre.text").first.inner_text()  # the token record's text
    assert HOSTILE in page.inner_text("pre.reply").replace('\\"', '"')  # the reply, as JSON
    page.close()
    page = _visit(browser, f"{console.url}rollouts/{GROUP}_g1", tmp_path, "failed")
    assert HOSTILE in page.inner_text("#attempts")  # the failure's reason
    page.close()
    page = _visit(browser, f"{console.url}checkpoints", tmp_path, "checkpoints")
    assert HOSTILE in page.inner_text("#checkpoints")  # the abort's reason
    page.close()
    page = _visit(browser, f"{console.url}checkpoints/ck-1", tmp_path, "checkpoint")
    assert HOSTILE in page.inner_text("main")
    page.close()
    for position in range(1, 16):
        page = _visit(browser, f"{console.url}events/{position}", tmp_path, f"event-{position}")
        page.close()
    for path in ("", "groups", f"groups/{GROUP}", "steps/3", "audit"):
        _visit(browser, console.url + path, tmp_path, f"page-{path.replace('/', '-') or 'overview'}").close()


def test_ids_in_urls_are_shown_as_text(
    browser: BrowserContext, console: ConsoleProcess, tmp_path: Path
) -> None:
    for i, path in enumerate(
        (
            f"rollouts/{quote(HOSTILE, safe='')}",
            f"groups/{quote(HOSTILE, safe='')}",
            f"checkpoints/{quote(HOSTILE, safe='')}",
            f"rollouts/{quote(HOSTILE, safe='')}/tries/0/payloads",
            f"steps/{quote(HOSTILE, safe='')}",
        )
    ):
        page = _visit(browser, console.url + path, tmp_path, f"url-{i}")
        assert HOSTILE in page.inner_text("main"), path
        page.close()
    for i, query in enumerate(("q", "agent", "trainer", "since", "step", "status")):
        page = _visit(
            browser, f"{console.url}groups?{query}={quote(HOSTILE, safe='')}", tmp_path, f"query-{i}"
        )
        page.close()


def test_the_audits_violations_link_to_their_events(
    browser: BrowserContext, console: ConsoleProcess, tmp_path: Path
) -> None:
    """The log above seals its group with one of its two siblings: the audit run from the page says
    so, and each violation's position opens that event."""
    page = browser.new_page()
    page.goto(console.url + "audit")
    page.click("#run-audit")
    result = page.locator("#audit-result")
    result.wait_for()
    assert result.get_attribute("data-ok") == "false"
    assert "group-seal-complete" in page.inner_text("#violations")
    link = page.locator("a.violation-event").first
    position = link.inner_text()
    link.click()
    page.wait_for_selector("#event-position")
    assert page.inner_text("#event-position") == position
    page.screenshot(path=str(tmp_path / "violation.png"), full_page=True)
    page.goto(console.url)
    assert page.inner_text("#audit-verdict").strip() == "violations"
    page.close()
