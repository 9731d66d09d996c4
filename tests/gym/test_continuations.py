"""Continuations in the participant library: saved at each turn boundary, resumed by a replacement try
(also after a restart with the state directory kept), declined cleanly otherwise.

The runner is a small multi-turn agent driven by gates: after committing turn k it waits until the test
lets it go on, so a retire (or a restart) lands at a known boundary.  What it generated is counted per
try, so "completed model calls are not regenerated" is asserted from what ran, not from what was said.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from participant.continuations import (
    ContinuationIndex,
    ContinuationStore,
    Declined,
    IndexRecord,
    decide_resume,
    read_index,
)
from participant.errors import GoneError
from participant.executions import ExecutionRegistry, RunSession
from payloads._local import LocalDirPayloadStore
from protocol.ids import capture_key
from protocol.wire import (
    ContinuationRef,
    ResourceRevision,
    RetireRequest,
    RunReply,
    RunRequest,
    TokenEntry,
)

ROLLOUT = "p1_g0"
TURNS = 4


def row(rollout_id: str = ROLLOUT, attempt_index: int = 0, question: str = "2+2?") -> RunRequest:
    return RunRequest(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        responses_create_params={"input": [{"role": "user", "content": question}]},
    )


class TurnRunner:
    """TURNS turns, each one model call (recorded) and a tool whose result joins the conversation;
    a boundary is committed after each turn but the last.  `hold[(n, k)]` (when set up) stops try n
    after it committed turn k until the event is set; `reached[(n, k)]` is set when it got there."""

    def __init__(self, resources: Sequence[ResourceRevision] = ()) -> None:
        self.calls: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.hold: dict[tuple[int, int], asyncio.Event] = {}
        self.reached: dict[tuple[int, int], asyncio.Event] = defaultdict(asyncio.Event)
        self.started_at: dict[tuple[str, int], int] = {}
        self.resources = list(resources)
        self.committed: list[ContinuationRef | None] = []

    async def __call__(self, request: RunRequest, session: RunSession) -> RunReply:
        key = (request.rollout_id, request.attempt_index)
        resumed = session.resumed
        conversation: list[str] = list(resumed.state["conversation"]) if resumed else ["prompt"]
        first = resumed.turn + 1 if resumed else 1
        self.started_at[key] = first
        for turn in range(first, TURNS + 1):
            await session.at_boundary()
            self.calls[key].append(turn)
            session.record(
                TokenEntry(
                    rollout_id=capture_key(*key),
                    model_call_id=f"call-{turn}",
                    model="m",
                    prompt_token_ids=[turn],
                    generation_token_ids=[10 * turn, 10 * turn + 1],
                    generation_log_probs=[-1.0, -1.5],
                    output_items=[{"type": "message", "id": f"m{turn}"}],
                    token_item_index=0,
                    created_at=0.0,
                )
            )
            conversation += [f"model-{turn}", f"tool-{turn}"]
            if turn < TURNS:
                ref = await session.commit_turn(turn, {"conversation": conversation}, self.resources)
                self.committed.append(ref)
                self.reached[(request.attempt_index, turn)].set()
                if (request.attempt_index, turn) in self.hold:
                    await self.hold[(request.attempt_index, turn)].wait()
        return RunReply(
            rollout_id=request.rollout_id,
            attempt_index=request.attempt_index,
            id=f"r-{capture_key(*key)}",
            response={"output": [{"type": "message", "text": " ".join(conversation)}]},
            reward=1.0,
        )


def registry(state_dir: Path, runner: TurnRunner, generation: int = 1, **kwargs: Any) -> ExecutionRegistry:
    return ExecutionRegistry(
        agent_name="a",
        generation=generation,
        runner=runner,
        state_dir=state_dir,
        continuations=ContinuationStore(state_dir, generation),
        **kwargs,
    )


async def _interrupted_at(reg: ExecutionRegistry, runner: TurnRunner, turn: int) -> ContinuationRef:
    """Try 0 runs to the boundary after `turn`, and is retired there: the offer it leaves."""
    runner.hold[(0, turn)] = asyncio.Event()
    task = asyncio.create_task(reg.run(row()))
    await runner.reached[(0, turn)].wait()
    answer = await reg.retire(RetireRequest(rollout_id=ROLLOUT, attempt_index=0))
    assert answer.retired and answer.continuation is not None
    with pytest.raises(GoneError):  # the retired try's call ends with it
        await task
    return answer.continuation


async def test_a_replacement_resumes_the_latest_boundary_and_reuses_its_model_calls(tmp_path: Path) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    offer = await _interrupted_at(reg, runner, 2)
    assert (offer.rollout_id, offer.source_attempt, offer.lineage, offer.turn) == (ROLLOUT, 0, ROLLOUT, 2)
    assert offer.model_call_ids == ["call-1", "call-2"] and offer.generated_tokens == 4
    assert runner.committed[-1] is not None and offer.digest == runner.committed[-1].digest

    outcome = await reg.run(row(attempt_index=1), continue_from=offer.digest)
    assert outcome.reply["reward"] == 1.0
    # Turns 1-2 ran once, in try 0; try 1 generated only turns 3 and 4.
    assert runner.calls[(ROLLOUT, 0)] == [1, 2] and runner.calls[(ROLLOUT, 1)] == [3, 4]
    assert reg.continuations is not None and reg.continuations.reads == 1  # one read, no replay
    records = reg.token_capture(capture_key(ROLLOUT, 1))
    assert [r.model_call_id for r in records] == ["call-1", "call-2", "call-3", "call-4"]
    # The reused records are the source try's own, filed under this try's capture key.
    assert {r.rollout_id for r in records} == {f"{ROLLOUT}-a1"}
    assert [r.generation_token_ids for r in records[:2]] == [[10, 11], [20, 21]]
    receipt = reg.completion_receipt(ROLLOUT, 1)
    assert receipt.resume is not None and receipt.resume.outcome == "resumed"
    assert (receipt.resume.source_attempt, receipt.resume.turn, receipt.resume.lineage) == (0, 2, ROLLOUT)
    assert receipt.resume.reused_model_calls == ["call-1", "call-2"] and receipt.resume.reused_tokens == 4
    assert receipt.resume.prompt_digest == row().prompt_digest()
    assert receipt.work is not None and receipt.work.generated_tokens == 4  # reused tokens not counted
    # The conversation carried on from the continuation's state, not from the prompt.
    assert outcome.reply["response"]["output"][0]["text"].split()[:5] == [
        "prompt",
        "model-1",
        "tool-1",
        "model-2",
        "tool-2",
    ]
    index = read_index(tmp_path)
    assert [r.kind for r in index.resumed] == ["resumed"] and not index.declined


async def test_a_chain_of_resumes_keeps_one_lineage(tmp_path: Path) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    first = await _interrupted_at(reg, runner, 1)
    runner.hold[(1, 2)] = asyncio.Event()
    task = asyncio.create_task(reg.run(row(attempt_index=1), continue_from=first.digest))
    await runner.reached[(1, 2)].wait()
    second = await reg.retire(RetireRequest(rollout_id=ROLLOUT, attempt_index=1))
    assert second.continuation is not None and second.resume is not None
    assert second.resume.outcome == "resumed" and second.resume.continuation == first.digest
    # Try 1 committed turn 2 on try 0's lineage: the offer is its own boundary.
    assert (second.continuation.source_attempt, second.continuation.turn) == (1, 2)
    assert second.continuation.lineage == ROLLOUT
    with pytest.raises(GoneError):
        await task
    await reg.run(row(attempt_index=2), continue_from=second.continuation.digest)
    assert [runner.calls[(ROLLOUT, n)] for n in range(3)] == [[1], [2], [3, 4]]


async def test_after_a_restart_with_the_state_kept_the_retire_offers_and_the_resume_works(
    tmp_path: Path,
) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    offer = await _interrupted_at(reg, runner, 3)
    reg.close()
    # A new process on the same state directory: no memory of try 0, the index and payloads kept.
    runner2 = TurnRunner()
    reg2 = registry(tmp_path, runner2, generation=2)
    answer = await reg2.retire(RetireRequest(rollout_id=ROLLOUT, attempt_index=0))
    assert answer.continuation == offer
    await reg2.run(row(attempt_index=1), continue_from=offer.digest)
    assert runner2.calls[(ROLLOUT, 1)] == [4]
    assert reg2.continuations is not None and reg2.continuations.reads == 1


async def test_with_the_state_lost_the_try_plays_from_its_prompt(tmp_path: Path) -> None:
    runner = TurnRunner()
    offer = await _interrupted_at(registry(tmp_path / "old", runner), runner, 2)
    runner2 = TurnRunner()
    reg2 = registry(tmp_path / "new", runner2)
    assert (await reg2.retire(RetireRequest(rollout_id=ROLLOUT, attempt_index=0))).continuation is None
    await reg2.run(row(attempt_index=1), continue_from=offer.digest)
    assert runner2.calls[(ROLLOUT, 1)] == [1, 2, 3, 4]
    resume = reg2.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and (resume.outcome, resume.reason) == ("declined", "unknown_continuation")
    # It started a lineage of its own.
    assert runner2.committed[0] is not None and runner2.committed[0].lineage == f"{ROLLOUT}-a1"


@pytest.mark.parametrize("damage", ["lost", "corrupt"])
async def test_a_lost_or_corrupt_continuation_is_declined_never_resumed(tmp_path: Path, damage: str) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    offer = await _interrupted_at(reg, runner, 2)
    assert reg.continuations is not None
    store = reg.continuations.payloads
    assert isinstance(store, LocalDirPayloadStore)
    path = store.path_of(offer.digest)
    if damage == "lost":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes().replace(b"tool-1", b"tool-X"))
    await reg.run(row(attempt_index=1), continue_from=offer.digest)
    assert runner.calls[(ROLLOUT, 1)] == [1, 2, 3, 4]
    resume = reg.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and resume.reason == f"continuation_{damage}"
    assert [r.reason for r in read_index(tmp_path).declined] == [f"continuation_{damage}"]


async def test_a_continuation_is_held_by_one_live_try_at_a_time(tmp_path: Path) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    runner.hold[(0, 2)] = asyncio.Event()
    source = asyncio.create_task(reg.run(row()))
    await runner.reached[(0, 2)].wait()
    offer = reg.offer(ROLLOUT, 0)
    assert offer is not None and offer.turn == 2
    # The try that committed it still runs: a stale owner's replacement may not take it up.
    await reg.run(row(attempt_index=1), continue_from=offer.digest)
    resume = reg.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and resume.reason == "source_live"
    await reg.retire(RetireRequest(rollout_id=ROLLOUT, attempt_index=0))
    with pytest.raises(GoneError):
        await source
    # Two replacements race for it: one resumes, the other plays from its prompt.
    runner.hold[(2, 3)] = asyncio.Event()
    first = asyncio.create_task(reg.run(row(attempt_index=2), continue_from=offer.digest))
    await runner.reached[(2, 3)].wait()
    await reg.run(row(attempt_index=3), continue_from=offer.digest)
    late = reg.completion_receipt(ROLLOUT, 3).resume
    assert late is not None and late.reason == "already_resumed"
    runner.hold[(2, 3)].set()
    await first
    assert runner.calls[(ROLLOUT, 2)] == [3, 4] and runner.calls[(ROLLOUT, 3)] == [1, 2, 3, 4]


async def test_a_different_prompt_is_refused(tmp_path: Path) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    offer = await _interrupted_at(reg, runner, 1)
    await reg.run(row(attempt_index=1, question="3+3?"), continue_from=offer.digest)
    resume = reg.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and resume.reason == "prompt_mismatch"


def _rev(name: str, cls: str, revision: int = 0) -> ResourceRevision:
    return ResourceRevision.model_validate(
        {"name": name, "resource_class": cls, "session": ROLLOUT, "revision": revision}
    )


async def test_export_restore_resources_are_restored_before_the_runner_and_restart_only_ones_restart(
    tmp_path: Path,
) -> None:
    restored: list[list[ResourceRevision]] = []

    async def restorer(resources: Sequence[ResourceRevision]) -> None:
        restored.append(list(resources))

    bank, calc = _rev("bank", "export_restore", 7), _rev("calc", "stateless")
    runner = TurnRunner([bank, calc])
    reg = registry(tmp_path / "ok", runner, restorer=restorer)
    offer = await _interrupted_at(reg, runner, 2)
    await reg.run(row(attempt_index=1), continue_from=offer.digest)
    assert restored == [[bank]]
    resume = reg.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and resume.restored == [bank]

    runner2 = TurnRunner([bank, _rev("sandbox", "restart_only")])
    reg2 = registry(tmp_path / "restart", runner2, restorer=restorer)
    offer2 = await _interrupted_at(reg2, runner2, 2)
    await reg2.run(row(attempt_index=1), continue_from=offer2.digest)
    assert runner2.calls[(ROLLOUT, 1)] == [1, 2, 3, 4]
    resume2 = reg2.completion_receipt(ROLLOUT, 1).resume
    assert resume2 is not None and resume2.reason == "restart_only_resource"
    assert len(restored) == 1  # nothing restored for a try that restarts


async def test_a_failed_restore_falls_back_to_the_prompt(tmp_path: Path) -> None:
    async def broken(resources: Sequence[ResourceRevision]) -> None:
        raise ConnectionError("resources server away")

    runner = TurnRunner([_rev("bank", "export_restore", 3)])
    reg = registry(tmp_path, runner, restorer=broken)
    offer = await _interrupted_at(reg, runner, 2)
    await reg.run(row(attempt_index=1), continue_from=offer.digest)
    resume = reg.completion_receipt(ROLLOUT, 1).resume
    assert resume is not None and resume.reason == "restore_failed" and "away" in resume.detail
    assert runner.calls[(ROLLOUT, 1)] == [1, 2, 3, 4]


async def test_an_agent_without_continuations_declines_and_does_not_declare_the_feature(
    tmp_path: Path,
) -> None:
    runner = TurnRunner()
    reg = ExecutionRegistry(agent_name="a", generation=1, runner=runner, state_dir=tmp_path)
    assert "turn_continuation" not in reg.features()
    await reg.run(row(), continue_from="sha256:" + "0" * 64)
    resume = reg.completion_receipt(ROLLOUT, 0).resume
    assert resume is not None and resume.reason == "not_resumable"
    assert runner.committed == [None, None, None]  # commit_turn is a no-op there
    assert "turn_continuation" in registry(tmp_path / "b", TurnRunner()).features()


def test_the_decision_alone() -> None:
    index = ContinuationIndex()
    digest = "sha256:" + "1" * 64
    prompt = row().prompt_digest()
    ref = ContinuationRef(
        rollout_id=ROLLOUT,
        source_attempt=0,
        lineage=ROLLOUT,
        turn=2,
        digest=digest,
        prompt_digest=prompt,
        model_call_ids=["call-1", "call-2"],
        generated_tokens=4,
    )
    assert decide_resume(digest, rollout_id=ROLLOUT, prompt_digest=prompt, index=index, live=()) == Declined(
        "unknown_continuation", f"no committed continuation {digest} of {ROLLOUT}"
    )
    index.committed[digest], index.holder[digest] = ref, (ROLLOUT, 0)
    assert decide_resume(digest, rollout_id=ROLLOUT, prompt_digest=prompt, index=index, live=()) == ref
    other = decide_resume(digest, rollout_id="p1_g1", prompt_digest=prompt, index=index, live=())
    assert isinstance(other, Declined) and other.reason == "unknown_continuation"
    live = decide_resume(digest, rollout_id=ROLLOUT, prompt_digest=prompt, index=index, live=[(ROLLOUT, 0)])
    assert isinstance(live, Declined) and live.reason == "source_live"
    # The prompt digest ignores the try's identity: every try of one sibling shares it.
    assert row(attempt_index=5).prompt_digest() == prompt != row(question="x").prompt_digest()
    # A later boundary of the lineage was committed (by a try that resumed this one): this one is
    # superseded, whoever asks (a stale owner's late resume would generate turns 3.. again).
    later = ref.model_copy(update={"digest": "sha256:" + "2" * 64, "turn": 4, "source_attempt": 1})
    index.apply(
        IndexRecord(
            kind="committed", rollout_id=ROLLOUT, attempt_index=1, digest=later.digest,
            execution_generation=1, at=0.0, ref=later,
        )
    )  # fmt: skip
    stale = decide_resume(digest, rollout_id=ROLLOUT, prompt_digest=prompt, index=index, live=())
    assert isinstance(stale, Declined) and stale.reason == "superseded" and "turn 4" in stale.detail
    assert (
        decide_resume(later.digest, rollout_id=ROLLOUT, prompt_digest=prompt, index=index, live=()) == later
    )


async def test_a_torn_last_index_line_is_skipped(tmp_path: Path) -> None:
    runner = TurnRunner()
    reg = registry(tmp_path, runner)
    offer = await _interrupted_at(reg, runner, 1)
    with open(tmp_path / "continuations.jsonl", "ab") as f:
        f.write(b'{"kind": "resumed", "rollout')
    index = read_index(tmp_path)
    assert index.torn_lines == 1 and index.offer(ROLLOUT, 0) == offer
