"""What the durable execution evidence costs the agent: tries through the participant's registry
(BATCH at once: start, complete, acknowledge together), with the evidence log's group commit against
the same registry whose log writes nothing (the baseline, measured in the same process).  The runner
answers at once, so the registry and the evidence are all that is measured.

    python -m benchmarks.participant_evidence                 # 2,000 tries, ACK batches of 32
    python -m benchmarks.participant_evidence --tries 300
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from participant.evidence import EvidenceKind, EvidenceLog
from participant.executions import ExecutionRegistry, RunSession
from protocol.wire import AcknowledgeItem, AcknowledgeRequest, RunReply, RunRequest


class NoEvidence(EvidenceLog):
    """The baseline: the same calls, nothing written."""

    async def commit(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> None:
        return None


async def instant(request: RunRequest, session: RunSession) -> RunReply:
    item = {
        "type": "message",
        "id": "m",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-1.0],
    }
    return RunReply(
        rollout_id=request.rollout_id,
        attempt_index=request.attempt_index,
        id=f"r-{request.rollout_id}",
        response={"output": [item]},
        reward=1.0,
    )


async def measure(state_dir: Path, durable: bool, tries: int, batch: int) -> tuple[float, float]:
    reg = ExecutionRegistry(agent_name="bench", generation=1, runner=instant, state_dir=state_dir)
    if not durable:
        reg.evidence.close()
        reg.evidence = NoEvidence(state_dir, 1)
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, tries, batch):
        ids = [f"t{i}" for i in range(start, min(tries, start + batch))]
        await asyncio.gather(*(reg.run(RunRequest(rollout_id=i, attempt_index=0)) for i in ids))
        items = [AcknowledgeItem(agent_name="bench", receipt=reg.completion_receipt(i, 0)) for i in ids]
        await reg.acknowledge(AcknowledgeRequest(executions=items))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    reg.evidence.close()
    return tries / wall, cpu / tries * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    table = Table(title=f"participant registry, {args.tries} tries, ACK batches of {args.batch}")
    for column in ("variant", "tries/s", "CPU ms/try", "vs baseline"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    with tempfile.TemporaryDirectory() as tmp:
        base_rate, base_cpu = asyncio.run(measure(Path(tmp) / "a", False, args.tries, args.batch))
        rate, cpu = asyncio.run(measure(Path(tmp) / "b", True, args.tries, args.batch))
    table.add_row("no evidence (baseline)", f"{base_rate:,.0f}", f"{base_cpu:.3f}", "1.00x")
    table.add_row("evidence, group commit", f"{rate:,.0f}", f"{cpu:.3f}", f"{base_rate / rate:.2f}x slower")
    Console().print(table)


if __name__ == "__main__":
    main()
