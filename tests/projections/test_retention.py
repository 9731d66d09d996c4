"""Retention and collection of payloads: only done groups' payloads are pruned, recorded before they go
(pruned is not missing, for the audit), unclaimed payloads are collected, and nothing put within the
grace is touched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import LogprobsRefused, PayloadsPruned
from eventstore.payload_stores import payload_plane
from payloads import LocalDirPayloadStore, PayloadClaim, StoredPayload
from projections.audit import audit_log
from projections.payload_audit import PAYLOAD_STORED
from projections.retention import PayloadRefs, collectable, fold_refs, prune_plan
from projections.runner import rebuild
from protocol.streams import RETENTION_STREAM, group_stream, logprobs_stream
from tests.projections.builder import LogBuilder


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    return url


@pytest.fixture
def store(url: str) -> Iterator[EventStore]:
    s = open_store(url)
    try:
        yield s
    finally:
        s.close()


def scored_group(log: LogBuilder, group_id: str, step: int | None = None) -> None:
    """A clean group whose tries the logprob queue has scored."""
    log.clean_sibling_group(group_id, step=step)
    for i in range(2):
        log.logprobs(f"{group_id}_g{i}")


def history(store: EventStore) -> LogBuilder:
    """`old` trained and behind a committed cut (archived at the second commit); `mid` trained after the
    first cut (still in play: a restore to it would roll its claim back); `new` sealed, not trained.
    Every try scored."""
    log = LogBuilder(store, payloads=payload_plane(store))
    scored_group(log, "old", step=1)
    log.checkpoint("c1")
    scored_group(log, "mid", step=2)
    log.checkpoint("c2")
    scored_group(log, "new")
    return log


def said(result: Result) -> str:
    """What a command printed, its lines joined (the console wraps at its width)."""
    return " ".join(result.output.split())


def reply_digests(store: EventStore, group_id: str) -> list[str]:
    return [
        json.loads(e.data_json)["reply"]["digest"]
        for e in store.read_stream(group_stream(group_id))
        if e.type == "RunReplied"
    ]


def local(store: EventStore) -> LocalDirPayloadStore:
    target = payload_plane(store).default
    assert isinstance(target, LocalDirPayloadStore)
    return target


def age(target: LocalDirPayloadStore, digests: list[str], seconds: float) -> None:
    """Makes the payloads look put `seconds` ago (their file times: what the directory store lists)."""
    then = time.time() - seconds
    for digest in digests:
        os.utime(target.path_of(digest), (then, then))


def test_prune_deletes_only_done_groups_payloads_after_recording_them(store: EventStore, url: str) -> None:
    history(store)
    assert set(rebuild(store).state("ledger").archived) == {"old"}
    old, mid, new = (reply_digests(store, g) for g in ("old", "mid", "new"))
    target = local(store)
    runner = CliRunner()

    # Everything was put a moment ago: within the default grace nothing goes.
    result = runner.invoke(app, ["payloads", "prune", "--db", url])
    assert result.exit_code == 0, said(result)
    assert "nothing to prune" in said(result) and "1 group(s) deferred" in said(result)
    assert store.stream_version(RETENTION_STREAM) == -1

    age(target, old + mid + new, 7200)
    result = runner.invoke(app, ["payloads", "prune", "--db", url, "--dry-run"])
    assert result.exit_code == 0 and "would prune 1 done group(s), 2 payload(s)" in said(result), said(result)
    assert target.contains(old) == set(old)

    result = runner.invoke(app, ["payloads", "prune", "--db", url])
    assert result.exit_code == 0, said(result)
    assert "pruned 1 done group(s), 2 payload(s)" in said(result) and "2 deleted" in said(result)
    [recorded] = [e.decode() for e in store.read_stream(RETENTION_STREAM)]
    assert isinstance(recorded, PayloadsPruned)
    assert (recorded.groups, recorded.digests, recorded.store) == (["old"], sorted(old), target.name)
    assert target.contains(old + mid + new) == set(mid + new)

    # Pruned is not missing: the audit counts them and stays clean; a second prune has nothing to do.
    report = audit_log(store, payloads=payload_plane(store))
    assert report.ok, report.as_json()
    assert report.payloads is not None and report.payloads.pruned == 2 and report.payloads.missing == 0
    result = runner.invoke(app, ["payloads", "prune", "--db", url, "--grace-s", "0"])
    assert result.exit_code == 0 and "nothing to prune" in said(result), said(result)

    # Missing is not pruned: a payload of a group in play that vanished is still a violation.
    target.path_of(mid[0]).unlink()
    report = audit_log(store, payloads=payload_plane(store))
    assert [v.rule for v in report.violations] == [PAYLOAD_STORED], report.as_json()
    assert mid[0] in report.violations[0].message


def test_collect_takes_only_unclaimed_payloads_put_before_the_grace(store: EventStore, url: str) -> None:
    history(store)
    target = local(store)
    claimed = [d for g in ("old", "mid", "new") for d in reply_digests(store, g)]
    [orphan] = payload_plane(store).put([(b'{"never": "claimed"}', "application/json")])
    runner = CliRunner()

    result = runner.invoke(app, ["payloads", "collect", "--db", url])
    assert result.exit_code == 0 and "collected 0 of 7 payload(s)" in said(result), said(result)
    age(target, [*claimed, orphan.digest], 7200)
    result = runner.invoke(app, ["payloads", "collect", "--db", url, "--dry-run"])
    assert result.exit_code == 0 and "would collect 1 of 7 payload(s)" in said(result), said(result)
    result = runner.invoke(app, ["payloads", "collect", "--db", url])
    assert result.exit_code == 0 and "collected 1 of 7" in said(result), said(result)
    assert target.contains([*claimed, orphan.digest]) == set(claimed)
    assert audit_log(store, payloads=payload_plane(store)).ok


def test_an_interrupted_prune_is_finished_by_collect(store: EventStore, url: str) -> None:
    history(store)
    old = reply_digests(store, "old")
    target = local(store)
    store.append(RETENTION_STREAM, [PayloadsPruned(store=target.name, groups=["old"], digests=sorted(old))])
    age(target, old, 7200)
    result = CliRunner().invoke(app, ["payloads", "collect", "--db", url])
    assert result.exit_code == 0 and "collected 2 of" in said(result), said(result)
    assert not target.contains(old)
    assert audit_log(store, payloads=payload_plane(store)).ok


def _claim(digest: str, store: str = "local") -> PayloadClaim:
    return PayloadClaim(store=store, digest=digest, size=10, media_type="application/json")


def _d(n: int) -> str:
    return "sha256:" + f"{n:064x}"


def test_the_plan_spares_shared_recent_and_already_gone_payloads() -> None:
    refs = PayloadRefs(
        by_group={"a": {_d(1), _d(2), _d(3)}, "b": {_d(2)}, "c": {_d(4)}, "d": {_d(5)}},
        claims={_d(n): _claim(_d(n)) for n in range(1, 6)},
        last_claimed={_d(n): n for n in range(1, 6)},
    )
    now = 10_000.0
    stored = {_d(n): StoredPayload(_d(n), 10, now - 7200) for n in (1, 2, 4, 5)}  # _d(3) already gone
    stored[_d(5)] = StoredPayload(_d(5), 10, now - 5)  # put again a moment ago
    plan = prune_plan(refs, {"a": 10, "c": 20, "d": 30}, stored, "local", now, grace_s=60)
    # a: its own payload goes; _d(2) is b's too (b is in play), _d(3) is not there to delete.
    assert (plan.groups, plan.digests, plan.deferred) == (["a", "c"], [_d(1), _d(4)], ["d"])
    assert prune_plan(refs, {"a": 10, "c": 20}, stored, "local", now, grace_s=60, keep_newest=1).groups == [
        "a"
    ]
    assert prune_plan(refs, {"a": 10}, stored, "elsewhere", now, grace_s=60).digests == []


def test_a_done_group_with_a_try_not_scored_yet_is_kept(store: EventStore) -> None:
    """A sealed try without its logprob result (computed or refused) keeps its group's payloads, and
    any payload it shares with a group that goes; `unscored_too` (no worker scores this log) does not."""
    log = LogBuilder(store)
    log.clean_sibling_group("a", step=1)
    log.logprobs("a_g0")  # a_g1 not scored yet
    log.clean_sibling_group("b", step=1)
    log.logprobs("b_g0")
    log.logprobs("b_g1")
    refs = fold_refs(store.read_all())
    assert refs.awaiting_scoring("a") and not refs.awaiting_scoring("b")
    stored = {d: StoredPayload(d, 10, 0.0) for g in ("a", "b") for d in refs.by_group[g]}
    plan = prune_plan(refs, {"a": 10, "b": 20}, stored, "log", 10_000.0, grace_s=60)
    assert (plan.groups, plan.awaiting_scoring) == (["b"], ["a"])
    # The builder's token records are the same bytes in every try: a's keep them for b's too.
    assert not set(plan.digests) & refs.by_group["a"]
    every = prune_plan(refs, {"a": 10, "b": 20}, stored, "log", 10_000.0, grace_s=60, unscored_too=True)
    assert (every.groups, every.awaiting_scoring) == (["a", "b"], [])
    log.append(
        logprobs_stream("a"),
        [LogprobsRefused(rollout_id="a_g1", attempt_index=0, policy_version="v1", reason="diverged")],
    )
    assert not fold_refs(store.read_all()).awaiting_scoring("a")  # a refusal is its result too


def test_bytes_claimed_again_after_a_prune_are_needed_again() -> None:
    refs = PayloadRefs()
    refs.last_claimed[_d(1)] = 5
    refs.pruned[_d(1)] = 9
    assert refs.is_pruned(_d(1)) and _d(1) not in refs.needed()
    refs.last_claimed[_d(1)] = 12  # a later event claims the same bytes
    assert not refs.is_pruned(_d(1)) and _d(1) in refs.needed()
    listed = [StoredPayload(_d(1), 10, 0.0), StoredPayload(_d(2), 10, 0.0)]
    assert collectable(refs, listed, now=10_000.0, grace_s=60) == [_d(2)]


def test_the_fold_reads_claims_from_group_and_logprobs_streams(store: EventStore) -> None:
    log = history(store)
    log.logprobs("new_g0")
    refs = fold_refs(store.read_all())
    assert set(refs.by_group) == {"old", "mid", "new"} and not refs.ungrouped
    assert set(reply_digests(store, "new")) < refs.by_group["new"]


def payloads_cli(
    command: str, url: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`ledger payloads COMMAND --db URL --grace-s 0 ARGS` in a subprocess of its own, with no
    `$LEDGER_PAYLOADS` but what `env` sets."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "payloads", command, "--db", url, "--grace-s", "0", *args],
        env={
            **{k: v for k, v in os.environ.items() if k != "LEDGER_PAYLOADS"},
            "COLUMNS": "200",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_refused_for_a_shared_store(refused: subprocess.CompletedProcess[str]) -> None:
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [line] = refused.stderr.splitlines()
    assert line.startswith("error: payload store ") and "is not the one beside this log" in line, line
    assert "nothing was deleted" in line and "--only-this-log" in line, line
    assert "Traceback" not in refused.stdout + refused.stderr


def test_collect_on_a_store_not_beside_the_log_wants_only_this_log(tmp_path: Path, url: str) -> None:
    """Two logs writing to one store (`$LEDGER_PAYLOADS` set for both): the other log's payloads look
    unclaimed to this one.  `collect` on a store that is not the one beside the log deletes nothing and
    says why in one line, unless told the log's processes alone write to it; the store beside the log,
    named or not, needs no such word.  Real subprocesses of the CLI."""
    other = f"sqlite:///{tmp_path / 'other.db'}"
    upgrade_database(other)
    shared = LocalDirPayloadStore(tmp_path / "shared")
    theirs = b'{"claimed": "by the other log"}'
    digest = "sha256:" + hashlib.sha256(theirs).hexdigest()
    shared.put(digest, theirs)
    age(shared, [digest], 7200)

    def collect(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return payloads_cli("collect", url, *args, env=env)

    for refused in (
        collect(env={"LEDGER_PAYLOADS": shared.root.as_uri()}),
        collect("--payloads", str(shared.root)),
    ):
        assert_refused_for_a_shared_store(refused)
        assert shared.contains([digest]) == {digest}
    dry = collect("--payloads", str(shared.root), "--dry-run")
    assert dry.returncode == 0 and "would collect 1 of 1" in " ".join(dry.stdout.split()), dry.stderr
    beside = collect("--payloads", (tmp_path / "ledger.db.payloads").as_uri())
    assert beside.returncode == 0 and "collected 0 of 0" in " ".join(beside.stdout.split()), beside.stderr
    told = collect("--payloads", str(shared.root), "--only-this-log")
    assert told.returncode == 0 and "collected 1 of 1" in " ".join(told.stdout.split()), told.stderr
    assert not shared.contains([digest])


def test_prune_on_a_store_not_beside_the_log_wants_only_this_log(
    tmp_path: Path, store: EventStore, url: str
) -> None:
    """Content-addressed: a done group's payload in a store another log writes to may be the other
    log's too (the same bytes), and pruning it would leave that log's claim without it.  `prune` on a
    store that is not the one beside the log records and deletes nothing, in one line, unless told the
    log's processes alone write to it (a dry run says what would go).  Real subprocesses of the CLI."""
    shared = tmp_path / "shared"
    log = LogBuilder(store, payloads=payload_plane(store, str(shared)))
    scored_group(log, "old", step=1)
    log.checkpoint("c1")
    log.checkpoint("c2")
    assert set(rebuild(store).state("ledger").archived) == {"old"}
    old = reply_digests(store, "old")
    target = LocalDirPayloadStore(shared)
    assert target.contains(old) == set(old)

    for refused in (
        payloads_cli("prune", url, env={"LEDGER_PAYLOADS": shared.as_uri()}),
        payloads_cli("prune", url, "--payloads", str(shared)),
    ):
        assert_refused_for_a_shared_store(refused)
        assert target.contains(old) == set(old)
        assert store.stream_version(RETENTION_STREAM) == -1  # nothing recorded as pruned either
    dry = payloads_cli("prune", url, "--payloads", str(shared), "--dry-run")
    assert dry.returncode == 0 and "would prune 1 done group(s)" in " ".join(dry.stdout.split()), dry.stderr
    told = payloads_cli("prune", url, "--payloads", str(shared), "--only-this-log")
    assert told.returncode == 0 and "pruned 1 done group(s)" in " ".join(told.stdout.split()), told.stderr
    assert not target.contains(old) and store.stream_version(RETENTION_STREAM) == 0
