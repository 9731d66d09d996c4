"""The peer benchmark end to end at a small scale, against the real Gym 0.7.0 (its environment built and
cached by `benchmarks/realgym/environment.py`): every side collects every rollout of its run, read from
what each side wrote (the collector's JSONL lines, the sealed rollouts in each ledger run's log), two
model calls each; the mounted agent kept evidence of every try the ledger ran through it.  The model
answers its router choices as NeMo RL's `nrlre1` envelope (`--routes envelope`; the real-Gym suite
covers the nested lists): each side keeps it as it came, and NeMo RL's hand-out reads it back as the
stub drew it.  No speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import peer
from eventstore import open_store
from eventstore.events import RolloutReceipt
from eventstore.payload_stores import payload_plane
from participant import read_evidence
from protocol.token_codec import read_layout
from trainer.ray_gym.results import decode_routes

ROLLOUTS = 24  # two groups' worth of the 12 in flight: a window after start-up exists


# One worker runs it with the real-Gym suite (`--dist=loadgroup`): one environment build.
@pytest.mark.slow
@pytest.mark.xdist_group("realgym")
def test_every_side_collects_every_rollout(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    code = peer.main(
        ["--sizes", "tiny", "--rounds", "1", "--rollouts", str(ROLLOUTS), "--keep", str(tmp_path / "runs"),
         "--routes", "envelope", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    runs = {r["side"]: r for r in result["runs"]}
    assert sorted(runs) == sorted(peer.SIDES)
    for run in runs.values():
        assert run["complete"] and run["rollouts"] == run["expected"] == ROLLOUTS, run
        assert run["model_calls_per_rollout"] == 2.0, run  # a tool call, then the answer: every rollout whole
    # What each side wrote, read here, not taken from the benchmark's own counts.
    [collected] = (tmp_path / "runs" / "tiny").glob("*-collector/rollouts.jsonl")
    lines = [json.loads(line) for line in collected.read_text().splitlines()]
    assert len(lines) == ROLLOUTS and all(line["reward"] == 1.0 for line in lines)
    assert all([i["type"] for i in line["response"]["output"]][-1] == "message" for line in lines)
    envelopes = [
        i["routed_experts"] for line in lines for i in line["response"]["output"] if "routed_experts" in i
    ]
    assert len(envelopes) == 2 * ROLLOUTS and all(e.startswith("nrlre1:int16:") for e in envelopes)
    for side in ("plain", "mounted"):
        [db] = (tmp_path / "runs" / "tiny").glob(f"*-{side}/ledger.db")
        store = open_store(f"sqlite:///{db}")
        try:
            seals = list(store.read_all(0, types=["SiblingSealed"]))
            sealed = {e.data["receipt"]["rollout_id"] for e in seals}
            # The envelope as the model sent it, in the stored token records, read as NeMo RL reads it.
            plane = payload_plane(store)
            claim = RolloutReceipt.model_validate(seals[0].data["receipt"]).tokens_claim()
            assert claim is not None
            records = read_layout(plane.get(claim)).records
            assert len(records) == 2, side  # the tool call's model call, then the answer's
            for record in records:
                routes = decode_routes(record["routed_experts"], "int16")
                n = routes.shape[0]
                assert routes.tolist() == [[[i % 8, (i + 3) % 8]] for i in range(n)], side
        finally:
            store.close()
        assert len(sealed) == ROLLOUTS, side
    evidence = read_evidence(tmp_path / "runs" / "tiny" / "gym" / "participant-state")
    counts = evidence.counts()
    assert counts["tries"] == counts["executions"] == counts["acknowledged"] == ROLLOUTS, counts
    assert evidence.duplicate_executions == 0 and not evidence.stranded
    summary = result["summary"]["tiny"]["sides"]
    assert all(summary[side]["complete"] == 1 for side in peer.SIDES)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rounds", "0"], "argument --rounds: 0 is not at least 1"),
        (["--sizes", "huge"], "argument --sizes: invalid choice: 'huge'"),
        (["--rollouts", "x"], "argument --rollouts: 'x' is not a whole number"),
        (["--rollouts", "huge=3"], "argument --rollouts: 'huge' is no size (tiny, 9k, 64k)"),
        (["--rollouts", "9k=0"], "argument --rollouts: 0 is not at least 1"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        peer.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err, err
