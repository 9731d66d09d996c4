"""The agent's durable execution evidence across restarts: a new process refuses every try an earlier
one recorded, the reader judges each try by its records in order, and compaction (also one cut short
by a crash) changes nothing the evidence says."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from gym_agent.server import serve_in_thread
from participant.evidence import (
    EVIDENCE_FILE,
    EvidenceKind,
    EvidenceLog,
    compact,
    read_evidence,
)
from participant.generation import GENERATION_FILE
from protocol.wire import ADOPT_ONLY_HEADER
from tests.gym.conftest import _config, run_request
from trainer.gym import GoneError, GymClient


def _body(rid: str, n: int) -> dict[str, object]:
    return run_request(rid, n).model_dump(mode="json", by_alias=True)


async def test_a_restarted_agent_refuses_a_stale_trainers_late_run_of_a_try_it_retired(
    tmp_path: Path,
) -> None:
    """The schedule of a stale owner: trainer A dispatched s_g0#0 and its /run is delayed; trainer B
    (same trainer id, recovered) retires it at the agent (tombstoned), runs the replacement #1, seals
    and ACKs it.  The agent restarts on the same state directory, and only then does A's /run arrive:
    the new process refuses it (410) and starts nothing, nor any other try its predecessor recorded
    (acknowledged, finished and unacknowledged, or retired), so no result strands there."""
    config = _config(tmp_path, "late", zero_work=True, turns=(1, 1))
    with serve_in_thread(config) as first:
        async with GymClient(first.url, "late") as b:
            assert (await b.retire("s_g0", 0)).tombstoned  # B retires A's dispatched try
            await b.run(run_request("s_g0", 1))  # the replacement, sealed and ACKed
            [ack] = await b.acknowledge([await b.completion_receipt("s_g0", 1)])
            assert ack.acknowledged
            await b.run(run_request("held_g0", 0))  # finished, never ACKed: lost with this process
        before = first.generation
    with serve_in_thread(config) as second:
        assert second.generation == before + 1
        async with httpx.AsyncClient(base_url=second.url, timeout=30) as raw:
            late = await raw.post("/run", json=_body("s_g0", 0))  # A's /run, at last
            assert late.status_code == 410 and late.json()["error"] == "gone", late.text
            for rid, n in (("s_g0", 1), ("held_g0", 0)):
                again = await raw.post("/run", json=_body(rid, n))
                assert again.status_code == 410, (rid, n, again.text)
                adopt = await raw.post("/run", json=_body(rid, n), headers={ADOPT_ONLY_HEADER: "1"})
                assert adopt.status_code == 410, (rid, n, adopt.text)
            status = (await raw.get("/status")).json()
            assert status["completed_unacknowledged"] == 0 and status["running"] == 0
            assert (await raw.get("/debug/runs")).json()["runs"] == {}
        async with GymClient(second.url, "late") as b:
            retired = await b.retire("s_g0", 0)
            assert retired.done and not retired.tombstoned  # done for good, nothing recorded anew
            with pytest.raises(GoneError):
                await b.completion_receipt("held_g0", 0)
            await b.run(run_request("fresh_g0", 0))  # a try never seen runs as ever
    evidence = read_evidence(config.resolved_state_dir)
    assert evidence.tries[("s_g0", 0)].started == []  # never executed, in either process
    assert all(second.generation not in t.started for k, t in evidence.tries.items() if k[0] != "fresh_g0")
    assert [t.rollout_id for t in evidence.stranded] == ["fresh_g0"]  # the one try the new process ran
    assert evidence.duplicate_executions == 0
    assert [t.rollout_id for t in evidence.lost_in_restart] == ["held_g0"]


def _write(state_dir: Path, generation: int, records: list[tuple[EvidenceKind, str]]) -> None:
    """Records of `generation`, in order, appended as the participant appends them (one fsync'd write)."""
    (state_dir / GENERATION_FILE).parent.mkdir(parents=True, exist_ok=True)
    (state_dir / GENERATION_FILE).write_text(f"{generation} {'a' * 32}\n")
    log = EvidenceLog(state_dir, generation)
    try:
        log._file.write(b"".join(log.lines(kind, [(rid, 0, rid)]) for kind, rid in records))
    finally:
        log.close()


def test_each_try_is_judged_by_its_last_record_in_the_newest_generation(tmp_path: Path) -> None:
    """A try tombstoned by generation 1 and then run to completion by generation 2 is a result the
    newest generation holds, not a retired try; every other order is read as it happened."""
    _write(
        tmp_path,
        1,
        [
            ("tombstoned", "revived"),
            ("started", "acked"),
            ("completed", "acked"),
            ("acknowledged", "acked"),
            ("started", "lost"),
            ("completed", "lost"),
            ("started", "cut"),
        ],
    )
    _write(tmp_path, 2, [("started", "revived"), ("completed", "revived"), ("tombstoned", "cut")])
    evidence = read_evidence(tmp_path)
    assert evidence.newest_generation == 2 and evidence.generations == [1, 2]
    assert [t.rollout_id for t in evidence.stranded] == ["revived"]
    assert [t.rollout_id for t in evidence.lost_in_restart] == ["lost"]
    revived = evidence.tries[("revived", 0)]
    assert (revived.last, revived.last_generation, revived.retired) == ("completed", 2, False)
    # ... and one run after an earlier process retired it (what a new process must refuse).
    assert [t.rollout_id for t in evidence.run_after_retired] == ["revived"]
    assert evidence.tries[("acked", 0)].acknowledged and evidence.tries[("cut", 0)].retired
    counts = evidence.counts()
    assert (counts["stranded"], counts["retired"], counts["acknowledged"]) == (1, 1, 1)


def _said(state_dir: Path) -> tuple[object, ...]:
    """What the evidence says, but for the wall times of its records."""
    e = read_evidence(state_dir)
    tries = {
        k: (t.started, t.completed, t.generations, t.retired_in, t.last, t.last_generation)
        for k, t in e.tries.items()
    }
    return tries, e.generations, e.newest_generation, e.torn_lines, e.counts()


def _history(state_dir: Path, tries: int) -> None:
    """Two generations' worth of records: started, completed, then ACKed or retired; some in flight."""
    for generation, offset in ((1, 0), (2, tries)):
        records: list[tuple[EvidenceKind, str]] = []
        for i in range(tries):
            rid = f"t{offset + i}"
            records.append(("started", rid))
            if i % 5 != 4:
                records += [("completed", rid), ("acknowledged" if i % 3 else "cancelled", rid)]
        _write(state_dir, generation, records)


def test_compaction_keeps_what_the_evidence_says_and_bounds_the_file(tmp_path: Path) -> None:
    plain, compacted = tmp_path / "plain", tmp_path / "compacted"
    _history(plain, 300)
    _history(compacted, 300)
    size = (compacted / EVIDENCE_FILE).stat().st_size
    new_size = compact(compacted / EVIDENCE_FILE)
    lines = (compacted / EVIDENCE_FILE).read_bytes().splitlines()
    assert len(lines) == 600 and new_size < 0.6 * size  # one line per try
    assert _said(compacted) == _said(plain)
    # Records written after a compaction follow the summaries and are folded after them.
    for d in (plain, compacted):
        _write(d, 3, [("started", "t4"), ("completed", "t4"), ("tombstoned", "new")])
    assert _said(compacted) == _said(plain)
    assert [t.rollout_id for t in read_evidence(compacted).stranded] == ["t4"]


async def test_the_log_compacts_as_it_grows_and_a_new_process_refuses_every_earlier_try(
    tmp_path: Path,
) -> None:
    log = EvidenceLog(tmp_path, 1, compact_min_bytes=16 * 1024)
    try:
        for i in range(400):
            await log.commit("started", [(f"g{i}", 0, f"g{i}")])
            await log.commit("completed", [(f"g{i}", 0, f"g{i}")])
            await log.commit("acknowledged", [(f"g{i}", 0, f"g{i}")])
    finally:
        log.close()
    assert log.compactions >= 2
    size = (tmp_path / EVIDENCE_FILE).stat().st_size
    assert size < 2 * log._compact_at  # bounded by twice the compacted size
    evidence = read_evidence(tmp_path)
    assert len(evidence.tries) == 400 and all(t.acknowledged for t in evidence.tries.values())
    again = EvidenceLog(tmp_path, 2, compact_min_bytes=16 * 1024)
    try:
        assert len(again.earlier) == 400 and ("g0", 0) in again.earlier and ("g399", 0) in again.earlier
        assert ("g0", 1) not in again.earlier and ("never", 0) not in again.earlier
    finally:
        again.close()


_CRASH = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import participant.durable as durable
    from participant.evidence import compact

    where, path = sys.argv[1], Path(sys.argv[2])
    real_replace, real_sync = os.replace, durable.sync_directory

    def replace(src, dst):
        if where == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    def sync(directory):
        if where == "after_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        real_sync(directory)

    durable.os.replace = replace
    durable.sync_directory = sync
    compact(path)
    """
)


@pytest.mark.parametrize("where", ["before_rename", "after_rename"])
def test_a_crash_mid_compaction_loses_nothing(tmp_path: Path, where: str) -> None:
    """The compacting process is SIGKILLed with the new file written but not yet renamed, or renamed
    but the directory not yet synced: the file read afterwards says exactly what it said before, and
    the next start reads it (and its leftover temporary file is no evidence)."""
    _history(tmp_path, 50)
    before = read_evidence(tmp_path)
    done = subprocess.run([sys.executable, "-c", _CRASH, where, str(tmp_path / EVIDENCE_FILE)], check=False)
    assert done.returncode == -9
    assert read_evidence(tmp_path) == before
    assert (tmp_path / f"{EVIDENCE_FILE}.tmp").exists() == (where == "before_rename")
    log = EvidenceLog(tmp_path, 3)
    try:
        assert len(log.earlier) == 100
    finally:
        log.close()


def test_a_torn_last_line_is_cut_off_at_the_next_start(tmp_path: Path) -> None:
    _write(tmp_path, 1, [("started", "a"), ("completed", "a")])
    whole = (tmp_path / EVIDENCE_FILE).stat().st_size
    with open(tmp_path / EVIDENCE_FILE, "ab") as f:
        f.write(json.dumps({"kind": "acknowledged", "rollout_id": "a"}).encode()[:20])  # a crash mid-write
    assert read_evidence(tmp_path).torn_lines == 1  # read before the restart: skipped, counted
    _write(tmp_path, 2, [("started", "b")])
    evidence = read_evidence(tmp_path)
    assert evidence.torn_lines == 0 and ("b", 0) in evidence.tries  # cut off; the record after it is whole
    assert (tmp_path / EVIDENCE_FILE).read_bytes()[whole:].startswith(b'{"crc":"')
    assert [t.rollout_id for t in evidence.lost_in_restart] == ["a"]


def test_a_file_of_an_older_version_is_read_as_it_was(tmp_path: Path) -> None:
    """Lines without a checksum (and a torn one an older version ended with a newline) before the
    first checksummed line are read as they were; records appended after them carry a checksum."""
    old = [
        {
            "kind": k,
            "rollout_id": "a",
            "attempt_index": 0,
            "capture_key": "a",
            "execution_generation": 1,
            "at": 1.0,
        }
        for k in ("started", "completed")
    ]
    text = "".join(json.dumps(r) + "\n" for r in old) + '{"kind": "acknowl\n'
    (tmp_path / EVIDENCE_FILE).write_text(text)
    assert read_evidence(tmp_path).torn_lines == 1
    _write(tmp_path, 2, [("acknowledged", "a")])
    evidence = read_evidence(tmp_path)
    assert evidence.tries[("a", 0)].acknowledged and evidence.torn_lines == 1
    assert (tmp_path / EVIDENCE_FILE).read_text().startswith(text)
