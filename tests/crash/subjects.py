"""The durable files the project writes with its own code, each written by its own writer and read back
by its owner's recovery path (`tests/crash/campaign.py` damages them)."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from gym_resources.book import JOURNAL_FILE, Book, journal_line
from gym_resources.server import serve_in_thread
from participant.checkpoint import (
    ActivePrefix,
    AgentCheckpoint,
    ParkedContinuation,
    checkpoint_path,
    read_checkpoint,
    write_checkpoint,
)
from participant.continuations import (
    CONTINUATIONS_FILE,
    Continuation,
    ContinuationStore,
    token_record,
)
from participant.driver import DRIVER_FILE, DriverBinding
from participant.durable import GroupCommitFile
from participant.evidence import EVIDENCE_FILE, EvidenceKind, EvidenceLog, compact, read_evidence
from participant.generation import GENERATION_FILE, next_identity
from participant.records import FileDamaged
from payloads import LocalDirPayloadStore, PayloadClaim, PayloadPlane, PayloadStoreError
from protocol.digests import sha256_digest
from protocol.wire import ResourceRevision, TokenEntry
from tests.crash.campaign import Subject, Written
from trainer.manifest import CheckpointManifest, ManifestMismatch, read_manifest, write_manifest


def _starts(data: bytes) -> list[int]:
    """Where each line of `data` starts."""
    starts, at = [], 0
    for line in data.splitlines(keepends=True):
        starts.append(at)
        at += len(line)
    return starts


class _Dir:
    """Resets the state directory to the pristine one with the subject's file replaced."""

    name: str
    owner: str
    file: str
    refusals: tuple[type[Exception], ...]
    names_offset: bool = True
    rewrites: tuple[Path, ...] = ()

    def reset(self, root: Path, pristine: Path, data: bytes) -> None:
        """Only the subject's file changes between cases: the owners' recoveries write nothing else
        that they read back (checked once, at the end of `tests/crash/campaign.run`)."""
        if not root.exists():
            shutil.copytree(pristine, root)
        (root / self.file).write_bytes(data)

    def append_probe(self, root: Path) -> None:
        raise AssertionError(f"{self.file} is replaced whole: nothing is appended to it")

    def probe_seen(self, state: object) -> bool:
        raise AssertionError(f"{self.file} is replaced whole: nothing is appended to it")


# --- the agent's execution evidence ------------------------------------------------------------------


class Evidence(_Dir):
    name = EVIDENCE_FILE
    file = EVIDENCE_FILE
    owner = "agent start: `EvidenceLog` (subprocess: `ledger gym serve`)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        next_identity(root)

        async def write() -> int:
            log = EvidenceLog(root, 1)
            log.clock = lambda: 1700000000.25
            try:
                tries = [(f"p{i}_g0", i % 2, f"p{i}_g0-k") for i in range(4)]
                await log.commit("started", tries)
                await log.commit("completed", tries[:3])
                await log.commit("tombstoned", tries[3:])
                compact(log.path)  # summaries first, as a long-lived agent's file is
                log.close()
                log = EvidenceLog(root, 2)
                log.clock = lambda: 1700000001.5
                await log.commit("started", [("q_g0", 0, "q_g0")])
                group = log.path.stat().st_size
                kinds: list[tuple[EvidenceKind, list[tuple[str, int, str]]]] = [
                    ("acknowledged", tries[:2]),
                    ("completed", [("q_g0", 0, "q_g0")]),
                ]
                # One group commit: appended together, written by one write and one fsync.
                await asyncio.gather(*(log.commit(kind, some) for kind, some in kinds))
                return group
            finally:
                log.close()

        group = asyncio.run(write())
        data = (root / EVIDENCE_FILE).read_bytes()
        return Written(Path(EVIDENCE_FILE), data, _starts(data), group, appendable=True)

    def recover(self, root: Path) -> object:
        log = EvidenceLog(root, 9)  # what the agent's start runs: reads, cuts a torn tail, may compact
        earlier = len(log.earlier)
        log.close()
        evidence = read_evidence(root)
        tries = {
            k: (t.started, t.completed, t.generations, t.retired_in, t.last, t.last_generation, t.at)
            for k, t in evidence.tries.items()
        }
        return earlier, tries, evidence.torn_lines

    def append_probe(self, root: Path) -> None:
        log = EvidenceLog(root, 9)
        try:
            log._file.write(log.lines("started", [("probe_g0", 0, "probe_g0")]))
        finally:
            log.close()

    def probe_seen(self, state: object) -> bool:
        return ("probe_g0", 0) in state[1]  # type: ignore[index]


# --- the continuation index --------------------------------------------------------------------------

ROLLOUT = "turns_g0"


def _continuation(turn: int, previous: str | None) -> Continuation:
    tokens = [
        token_record(
            TokenEntry(
                rollout_id=ROLLOUT,
                model_call_id=f"call-{t}",
                model="m",
                prompt_token_ids=[t],
                generation_token_ids=[10 * t, 10 * t + 1],
                generation_log_probs=[-1.0, -1.5],
                created_at=0.0,
            )
        )
        for t in range(1, turn + 1)
    ]
    return Continuation(
        rollout_id=ROLLOUT,
        lineage=ROLLOUT,
        source_attempt=0 if turn < 3 else 1,
        turn=turn,
        prompt_digest=sha256_digest(b"the prompt"),
        tokens=tokens,
        state={"conversation": ["prompt", *(f"turn-{t}" for t in range(1, turn + 1))]},
        resources=[
            ResourceRevision(name="bank", resource_class="export_restore", session=ROLLOUT, revision=turn)
        ],
        previous=previous,
    )


class ContinuationIndex(_Dir):
    name = CONTINUATIONS_FILE
    file = CONTINUATIONS_FILE
    owner = "agent start: `ContinuationStore` (subprocess: `ledger gym serve --turn-continuation`)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        async def write() -> int:
            store = ContinuationStore(root, 1)
            try:
                first = await store.commit(_continuation(1, None), 0)
                second = await store.commit(_continuation(2, first.digest), 0)
                await store.record_declined(sha256_digest(b"gone"), "other_g0", 0, "unknown_continuation")
                group = store.path.stat().st_size
                # One group commit: the replacement try 1 resumes turn 2 and commits turn 3 while a
                # decline is recorded; the lines queued together go out in one write.
                await asyncio.gather(
                    store.record_resumed(second, ROLLOUT, 1),
                    store.record_declined(first.digest, ROLLOUT, 2, "superseded"),
                )
                await store.commit(_continuation(3, second.digest), 1)
                return group
            finally:
                store.close()

        group = asyncio.run(write())
        data = (root / CONTINUATIONS_FILE).read_bytes()
        return Written(Path(CONTINUATIONS_FILE), data, _starts(data), group, appendable=True)

    def recover(self, root: Path) -> object:
        store = ContinuationStore(root, 9)  # what the agent's start runs with continuations on
        store.close()
        return replace(store.index, torn_lines=0)

    def append_probe(self, root: Path) -> None:
        store = ContinuationStore(root, 9)
        try:
            asyncio.run(store.record_declined(sha256_digest(b"probe"), "probe_g0", 0, "unknown_continuation"))
        finally:
            store.close()

    def probe_seen(self, state: object) -> bool:
        return any(r.rollout_id == "probe_g0" for r in state.declined)  # type: ignore[attr-defined]


# --- the resources server's journal ------------------------------------------------------------------


class ResourcesJournal(_Dir):
    name = JOURNAL_FILE
    file = JOURNAL_FILE
    owner = "server start: `Book.recover` (subprocess: `ledger gym resources`)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        def key(turn: int, call: int = 0) -> dict[str, Any]:
            return {"rollout_id": ROLLOUT, "lineage": ROLLOUT, "turn": turn, "call": call}

        calls: list[tuple[str, str, dict[str, Any]]] = [
            ("bank", "call", {"session": "s1", "key": key(1), "tool": "deposit", "arguments": {"amount": 50}}),
            ("bank", "call", {"session": "s1", "key": key(2), "tool": "withdraw", "arguments": {"amount": 20}}),
            ("mailer", "call", {"session": "s1", "key": key(2, 1), "tool": "send", "arguments": {"to": "a", "body": "b"}}),
            ("bank", "call", {"session": "s1", "key": key(1), "tool": "deposit", "arguments": {"amount": 50}}),
            ("bank", "restore", {"session": "s1", "revision": 1}),
            ("mailer", "release", {"session": "s1"}),
            ("bank", "call", {"session": "s1", "key": key(3), "tool": "deposit", "arguments": {"amount": 7}}),
        ]  # fmt: skip
        with serve_in_thread(root) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            for name, op, body in calls:
                client.post(f"/resources/{name}/{op}", json=body).raise_for_status()
        data = (root / JOURNAL_FILE).read_bytes()
        starts = _starts(data)
        return Written(Path(JOURNAL_FILE), data, starts, starts[-1], appendable=True)

    def recover(self, root: Path) -> object:
        book = Book.recover(root)  # what the server's start runs
        sessions = {k: (s.states, s.applied) for k, s in sorted(book.sessions.items())}
        return sessions, book.effects.as_json()

    def append_probe(self, root: Path) -> None:
        journal = GroupCommitFile(root / JOURNAL_FILE)
        try:
            line = {"op": "call", "resource": "bank", "session": "probe", "key": "probe", "tool": "deposit"}
            journal.write(
                journal_line({**line, "attempt": 0, "output": {"balance": 1}, "state": {"balance": 1}})
            )
        finally:
            journal.close()

    def probe_seen(self, state: object) -> bool:
        return ("bank", "probe") in state[0]  # type: ignore[index]


# --- files replaced whole ----------------------------------------------------------------------------


class Generation(_Dir):
    name = GENERATION_FILE
    file = GENERATION_FILE
    owner = "agent start: `next_identity` (subprocess: `ledger gym serve`)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        for _ in range(3):
            next_identity(root)
        return Written(Path(GENERATION_FILE), (root / GENERATION_FILE).read_bytes(), [0], 0, appendable=False)

    def recover(self, root: Path) -> object:
        return next_identity(root).generation


class Driver(_Dir):
    name = DRIVER_FILE
    file = DRIVER_FILE
    owner = "agent start: `DriverBinding` (subprocess: `ledger gym serve`)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        DriverBinding("a", root).bind("trainer-7")
        return Written(Path(DRIVER_FILE), (root / DRIVER_FILE).read_bytes(), [0], 0, appendable=False)

    def recover(self, root: Path) -> object:
        binding = DriverBinding("a", root)
        return binding.bound, binding.trainer_id


class CheckpointArtefact(_Dir):
    name = "checkpoints/<id>.json"
    file = "checkpoints/ck-1.json"
    owner = "`read_checkpoint` (no restart reads it yet)"
    refusals: tuple[type[Exception], ...] = (FileDamaged,)

    def build(self, root: Path) -> Written:
        prefix = ActivePrefix(
            model_call_id="call-2",
            generation_token_ids=[5, 6, 7],
            generation_log_probs=[-0.5, -0.25, -2.0],
            model_s=0.75,
        )
        parked = [
            ParkedContinuation(rollout_id="a_g0", attempt_index=0, capture_key="a_g0", model_calls_done=1),
            ParkedContinuation(
                rollout_id="b_g0",
                attempt_index=1,
                capture_key="b_g0-a1",
                model_calls_done=2,
                active_prefix=prefix,
            ),
        ]
        path = write_checkpoint(
            root, AgentCheckpoint(agent_name="a", checkpoint_id="ck-1", execution_generation=3, parked=parked)
        )
        return Written(path.relative_to(root), path.read_bytes(), [0], 0, appendable=False)

    def recover(self, root: Path) -> object:
        return read_checkpoint(checkpoint_path(root, "ck-1")).model_dump()


class Manifest(_Dir):
    name = "ledger-checkpoint.json"
    file = "ledger-checkpoint.json"
    owner = "trainer restore: `read_manifest`"
    refusals: tuple[type[Exception], ...] = (ManifestMismatch,)

    def build(self, root: Path) -> Written:
        root.mkdir(parents=True, exist_ok=True)
        manifest = CheckpointManifest(
            checkpoint_id="ck-7",
            trainer_checkpoint="step_7",
            trainer_id="trainer-a",
            cut_position=1234,
            cut_hash="ab" * 32,
            log_identity="cd" * 32,
            config_fingerprint=sha256_digest(b"settings"),
        )
        path = write_manifest(root, manifest)
        return Written(Path(path.name), path.read_bytes(), [0], 0, appendable=False)

    def recover(self, root: Path) -> object:
        return read_manifest(root).model_dump()


class Payload(_Dir):
    name = "payloads/sha256/<2>/<hex>"
    owner = "reader after a restart: `PayloadPlane.get` over `LocalDirPayloadStore`"
    refusals: tuple[type[Exception], ...] = (PayloadStoreError,)
    # A content-addressed file has no records: its hash says it is damaged, not where.
    names_offset = False

    def build(self, root: Path) -> Written:
        items = [
            (f'{{"reply": {i}, "text": "{"x" * 40 * i}"}}'.encode(), "application/json") for i in range(1, 4)
        ]
        store = LocalDirPayloadStore(root / "payloads")
        self.claim: PayloadClaim = PayloadPlane(store).put(items)[-1]  # one group commit; the last file
        # Retired (one syncfs, the batch file removed): the payload's own file is its only copy, as
        # it is from the next retirement on (`PayloadBatch` crashes the batch file before that).
        store.close()
        path = store.path_of(self.claim.digest)
        self.file = str(path.relative_to(root))
        return Written(path.relative_to(root), path.read_bytes(), [0], 0, appendable=False)

    def recover(self, root: Path) -> object:
        return PayloadPlane(LocalDirPayloadStore(root / "payloads")).get(self.claim)


class PayloadBatch(_Dir):
    name = "payloads/batches/<name>.batch"
    owner = "the next writer's open (`LocalDirPayloadStore` replays a dead writer's batch), then `get`"
    refusals: tuple[type[Exception], ...] = (PayloadStoreError,)

    def build(self, root: Path) -> Written:
        """A writer killed after its group commit's batch file was durable and before its payloads'
        own files were written: the batch file holds the only copy of the three payloads."""
        store = LocalDirPayloadStore(root / "payloads")
        items = [
            (f'{{"reply": {i}, "text": "{"y" * 40 * i}"}}'.encode(), "application/json") for i in range(1, 4)
        ]
        self.claims = PayloadPlane(store).put(items)
        own = [store.path_of(claim.digest) for claim in self.claims]
        for path in own:
            path.unlink()
        self.rewrites = tuple(path.relative_to(root) for path in own)  # what a replay writes
        (batch,) = (root / "payloads" / "batches").glob("*.batch")
        self.file = str(batch.relative_to(root))
        return Written(batch.relative_to(root), batch.read_bytes(), [0], 0, appendable=False)

    def reset(self, root: Path, pristine: Path, data: bytes) -> None:
        """A replay writes the payloads' files and removes the batch: each case starts over."""
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine, root)
        (root / self.file).write_bytes(data)

    def recover(self, root: Path) -> object:
        plane = PayloadPlane(LocalDirPayloadStore(root / "payloads"))
        return [plane.get(claim) for claim in self.claims]


SUBJECTS: dict[str, Subject] = {
    s.name: s
    for s in (
        Evidence(),
        ContinuationIndex(),
        ResourcesJournal(),
        Generation(),
        Driver(),
        CheckpointArtefact(),
        Manifest(),
        Payload(),
        PayloadBatch(),
    )
}
