"""`LedgerGym`: a drop-in for NeMo RL's `NemoGym` Ray actor, with the coordinator and its log inside.

    from trainer.ray_gym import LedgerGymConfig, ledger_gym_actor
    gym = ledger_gym_actor().remote(LedgerGymConfig(db_url=url, agents={"math": "http://..."}))
    ray.get(gym._spinup.remote())
    async for ref in gym.run_rollouts.options(num_returns="streaming").remote(rows, "timing/rollout"):
        rowidx, result, timing = await ref

NeMo RL's actor is `@ray.remote(max_restarts=-1, max_task_retries=-1)`: Ray restarts a dead actor
(its constructor runs again) and calls a task that was in flight again with the same arguments.  Here
that is safe by construction:

- an actor that (re)starts folds the log and recovers (`RolloutCoordinator.recover`): tries in flight
  are retired or adopted, debts paid, open groups driven on;
- a retried `run_rollouts` plans the same group ids from the same rows and `submit` is idempotent,
  so it resumes the groups instead of running them again.  The first occurrence of the rows not
  wholly claimed is resumed; under Ray also one wholly claimed by this very call (each claim records
  the call's Ray task id, the same on every retry of it), since its first attempt may have died
  before its caller had every item.  Another call with the same rows gets groups of its own;
- each group is claimed for training (an append) before its rows are yielded, and a retried stream
  first yields again, in claim order, the groups the first attempt claimed.  Ray replays a streaming
  generator and drops the items its caller already has by index, so the replay must yield the same
  items in the same order: the log's claim order is that order.

Results come in completion order of groups (rows of a group in generation order); a group that used
up its retry budget ends the stream with `RowsDeadLettered`.  No wait is unbounded: a call gives up
after `call_budget_s` with `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from eventstore import EventStore, open_store
from eventstore.events import Mode
from protocol.ids import Identifier
from protocol.streams import group_stream
from trainer.checkpoint import CheckpointOutcome, PreparedCheckpoint
from trainer.context import log
from trainer.coordinator import RolloutCoordinator
from trainer.errors import AlreadyClaimed
from trainer.gym import GymClient
from trainer.ray_gym.rows import (
    DEFAULT_GROUP_PREFIX,
    GroupRecord,
    PlannedGroup,
    RowError,
    RowsDeadLettered,
    call_digest,
    group_id,
    plan_call,
    read_group,
    row_result,
    split_groups,
)

# NeMo RL's own actor options: restart for ever, retry a task in flight for ever.
ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": -1, "max_task_retries": -1}
# The longest an actor that is asked to stop spends closing its coordinator at exit (inside the usual
# 30 s a supervisor waits between SIGTERM and SIGKILL).
EXIT_BUDGET_S = 20.0


class LedgerGymConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    db_url: str
    agents: dict[Identifier, str]  # agent name (a row's agent_ref.name) -> its base URL
    agent_token: str | None = None
    mode: Mode = "prompt_group"
    # Rows per prompt group; None: contiguous rows equal but for `_rowidx` form one group.
    num_generations: int | None = Field(default=None, ge=1)
    group_prefix: str = DEFAULT_GROUP_PREFIX
    trainer_id: Identifier | None = None
    rollout_timeout_s: float = Field(default=600.0, gt=0)
    prepare_timeout_s: float = Field(default=300.0, gt=0)
    park_grace_s: float = Field(default=1.0, gt=0)
    max_tries: int = Field(default=4, ge=1)
    # The longest one `run_rollouts` call waits for its groups before it gives up.
    call_budget_s: float = Field(default=6 * 3600.0, gt=0)
    # Serve the log's figures on /metrics from inside the actor (the `metrics` extra); 0: a free port.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_addr: str = "127.0.0.1"


class LedgerGym:
    """The actor's body (plain Python: usable, and tested, without Ray as well)."""

    def __init__(self, config: LedgerGymConfig | dict[str, Any]) -> None:
        self.config = config if isinstance(config, LedgerGymConfig) else LedgerGymConfig(**config)
        self.store: EventStore | None = None
        self.coord: RolloutCoordinator | None = None
        self.clients: dict[str, GymClient] = {}
        self._tokenizer: Any = None
        self._lock: asyncio.Lock | None = None
        self._metrics: Any = None
        self._exit_hook: Any = None

    # --- NeMo RL's actor surface ----------------------------------------------------------------

    async def _spinup(self) -> None:
        """Opens the log and recovers the coordinator from it (also done lazily by every call)."""
        await self._coordinator()

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Kept for NeMo RL's call; the results carry token ids, so no tokenizer is needed here."""
        self._tokenizer = tokenizer

    async def health_check(self) -> None:
        coord = await self._coordinator()
        if coord.errors:
            raise coord.errors[0]
        if coord.journal.stopped is not None:
            raise coord.journal.stopped

    async def run_rollouts(
        self,
        nemo_gym_examples: list[dict[str, Any]],
        timer_prefix: str,
        deduplicate_multimodal_data: bool = False,
        train_step: int = 0,
    ) -> AsyncIterator[tuple[int, dict[str, Any], dict[str, float] | None]]:
        """Streams `(rowidx, result, timing)` as groups seal; see the module doc for retries."""
        started = time.monotonic()
        coord = await self._coordinator()
        rows = nemo_gym_examples
        runs = split_groups(rows, self.config.num_generations)
        call_id = self._call_id()
        digest = call_digest(rows)
        occurrence, records = await self._occurrence(digest, len(runs), call_id)
        planned = plan_call(runs, digest, occurrence, self.config.group_prefix)
        for p in planned:
            await coord.submit(
                p.group_id, p.prompt_ref, p.agent_name, len(p.rows), p.payload, mode=self.config.mode
            )
        pending = {p.group_id: p for p in planned}
        total, sent = len(rows), 0
        # A retry: what the first attempt delivered, again, in the order the log says it went out.
        replay = sorted((r.claim_position, gid) for gid, r in records.items() if r.claim_position is not None)
        order = [gid for _, gid in replay]
        deadline = started + self.config.call_budget_s
        while pending:
            if not order:
                order = [gid for gid in pending if self._settled(coord, gid)]
            if not order:
                if coord.errors:
                    raise coord.errors[0]
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(pending)} group(s) of this call still open after {self.config.call_budget_s:g} s"
                    )
                await coord.journal.wait_changed(0.5)
                continue
            gid = order.pop(0)
            group = pending.pop(gid)
            items = await self._deliver(coord, group, train_step, call_id)
            for rowidx, result in items:
                sent += 1
                timing = None
                if sent == total:
                    timing = {f"{timer_prefix}/ledger_total_s": time.monotonic() - started}
                yield rowidx, result, timing

    async def checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """The one-call checkpoint: prepare, then commit (or the abort prepare ended in)."""
        return _outcome(await (await self._coordinator()).checkpoint(checkpoint_id))

    async def prepare_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """Split phase, first step: `{"prepared": True, ...}` once every agent is prepared (the trainer
        saves now, then calls `commit_checkpoint` or `abort_checkpoint`), else the aborted outcome."""
        result = await (await self._coordinator()).prepare_checkpoint(checkpoint_id)
        if isinstance(result, PreparedCheckpoint):
            return {
                "prepared": True,
                "committed": False,
                "reason": "",
                "prepare_wait_s": result.prepare_wait_s,
            }
        return {"prepared": False, **_outcome(result)}

    async def commit_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        return _outcome(await (await self._coordinator()).commit_checkpoint(checkpoint_id))

    async def abort_checkpoint(
        self, checkpoint_id: str, reason: str = "aborted by the trainer"
    ) -> dict[str, Any]:
        return _outcome(await (await self._coordinator()).abort_checkpoint(checkpoint_id, reason))

    async def record_logprobs(
        self, rollout_id: str, attempt_index: int, logprobs: list[float], policy_version: str
    ) -> bool:
        """NeMo RL's `prev_logprobs` of one row (`full_result["_ng_rollout_id"]`, `["_ng_attempt_index"]`)
        recorded as its `LogprobsComputed`; see `RolloutCoordinator.record_logprobs`."""
        coord = await self._coordinator()
        return await coord.record_logprobs(rollout_id, attempt_index, logprobs, policy_version)

    async def metrics(self) -> dict[str, float]:
        return await (await self._coordinator()).metrics()

    async def wait_idle(self, timeout_s: float = 60.0) -> None:
        await (await self._coordinator()).wait_idle(timeout_s)

    async def shutdown(self) -> None:
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.coord is not None:
            await self.coord.close()
            await self.coord.journal.drain()
            self.coord = None
        for client in self.clients.values():
            await client.aclose()
        self.clients = {}
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None

    # --- inside -----------------------------------------------------------------------------------

    def _close_at_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM (Ray stopping the actor, a supervisor stopping the job) ends an actor's process by
        `sys.exit`: the exit then closes the coordinator as `shutdown` does (a prepared checkpoint
        nobody decided is aborted at the agents, the drivers stop, the log is closed), on the actor's
        own event loop, stopped by then, within EXIT_BUDGET_S.  A process killed outright leaves that
        to the next recovery."""
        owner = threading.get_ident()

        def at_exit() -> None:
            if loop.is_closed() or self.coord is None:
                return
            self._exit_hook = None  # being run: nothing to unregister
            work = asyncio.wait_for(self.shutdown(), EXIT_BUDGET_S)
            try:
                if not loop.is_running():
                    # The interpreter's exit shut the thread pools down: the log's calls run inline.
                    loop.set_default_executor(_InlineExecutor())
                    loop.run_until_complete(work)
                elif threading.get_ident() != owner:
                    asyncio.run_coroutine_threadsafe(work, loop).result(EXIT_BUDGET_S + 1)
                else:
                    work.close()
            except Exception:  # exiting anyway: the next recovery presumes what is left aborted
                log.exception("closing the coordinator at exit failed")

        self._exit_hook = at_exit
        atexit.register(at_exit)

    async def _coordinator(self) -> RolloutCoordinator:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.coord is None:
                c = self.config
                self.store = await asyncio.to_thread(open_store, c.db_url, migrate_schema=True)
                self.clients = {
                    name: GymClient(url, name, token=c.agent_token) for name, url in c.agents.items()
                }
                self._close_at_exit(asyncio.get_running_loop())
                self.coord = await RolloutCoordinator.recover(
                    self.store,
                    self.clients,
                    mode=c.mode,
                    rollout_timeout_s=c.rollout_timeout_s,
                    prepare_timeout_s=c.prepare_timeout_s,
                    park_grace_s=c.park_grace_s,
                    max_tries=c.max_tries,
                    trainer_id=c.trainer_id,
                )
                if c.metrics_port is not None and self._metrics is None:
                    from projections.exporter import serve_metrics
                    from trainer.telemetry import journal_families

                    self._metrics = serve_metrics(
                        self.store, c.metrics_port, [journal_families], c.metrics_addr
                    )
            return self.coord

    def metrics_port(self) -> int | None:
        """The port `/metrics` is served on (after spin-up), if any."""
        return self._metrics.port if self._metrics is not None else None

    async def _records(self, gids: list[str]) -> dict[str, GroupRecord]:
        store, coord = self.store, self.coord
        assert store is not None and coord is not None
        # Through the journal: a database outage is ridden out as the coordinator's own reads are.
        return await coord.journal.read(
            lambda: {gid: read_group(gid, store.read_stream(group_stream(gid))) for gid in gids},
            "reading group streams",
        )

    def _call_id(self) -> str | None:
        """The Ray task this call runs as: the same on every retry of it (None outside a Ray actor)."""
        try:
            import ray
        except ImportError:
            return None
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None
        task_id: str | None = context.get_task_id()
        return task_id

    async def _occurrence(
        self, digest: str, groups: int, call_id: str | None = None
    ) -> tuple[int, dict[str, GroupRecord]]:
        """The first occurrence of these rows not wholly claimed (a retry resumes it), or wholly
        claimed by this very call (`call_id`: a retry whose first attempt claimed every group, then
        died before its caller had every item: it replays them all and Ray drops those its caller
        has), with the records of its groups already in the log."""
        coord = self.coord
        assert coord is not None
        prefix = self.config.group_prefix
        occurrence = 0
        while True:
            gids = [group_id(prefix, digest, occurrence, k) for k in range(groups)]
            known = [g for g in gids if coord.ledger.knows_group(g)]
            if not known:
                return occurrence, {}
            records = await self._records(known)
            ours = call_id is not None and all(r.claim_call == call_id for r in records.values())
            if ours or len(known) < groups or any(r.claim_position is None for r in records.values()):
                return occurrence, records
            occurrence += 1

    @staticmethod
    def _settled(coord: RolloutCoordinator, gid: str) -> bool:
        group = coord.ledger.groups.get(gid)
        return (group.status != "open") if group is not None else gid in coord.ledger.archived

    async def _deliver(
        self, coord: RolloutCoordinator, group: PlannedGroup, train_step: int, call_id: str | None
    ) -> list[tuple[int, dict[str, Any]]]:
        """Claims the group (durably, before anything is yielded) and builds its rows' results."""
        [record] = (await self._records([group.group_id])).values()
        if record.dead_letter_reasons is not None:
            raise RowsDeadLettered(
                f"group {group.group_id} (rows {group.rows}) used up its retry budget: "
                + "; ".join(record.dead_letter_reasons[:5])
            )
        if not record.sealed or len(record.seals) != len(group.rows):
            raise RowError(f"group {group.group_id} left play without a seal of every row")
        with contextlib.suppress(AlreadyClaimed):
            await coord.claim_for_training(group.group_id, train_step, call_id=call_id)
        store = self.store
        assert store is not None

        def build() -> list[tuple[int, dict[str, Any]]]:
            out = []
            blobs = store.get_blobs([d for seal in record.seals.values() for d in seal if d])
            for gi, rowidx in enumerate(group.rows):
                reply_digest, tokens_digest = record.seals[gi]
                reply, tokens = blobs.get(reply_digest), blobs.get(tokens_digest)
                if reply is None or tokens is None:
                    raise RowError(
                        f"group {group.group_id}: sibling {gi}'s reply or tokens are not in the log"
                    )
                out.append((rowidx, row_result(json.loads(reply), tokens)))
            return out

        return await coord.journal.read(build, "reading replies and token records")


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each call in the caller's thread: what `asyncio.to_thread` gets once the interpreter is
    exiting and no pool takes new work (the actor's close at exit, one step after another)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered to the awaiting coroutine, as a pool would
            done.set_exception(exc)
        return done


def ledger_gym_actor(**options: Any) -> Any:
    """`LedgerGym` as a Ray actor class with NeMo RL's restart and retry options (plus `options`)."""
    import ray

    return ray.remote(**ACTOR_OPTIONS)(LedgerGym).options(**options)


def _outcome(outcome: CheckpointOutcome) -> dict[str, Any]:
    """A decided checkpoint as the actor answers it (plain data across the Ray boundary)."""
    return {
        "committed": outcome.committed,
        "reason": outcome.reason,
        "prepare_wait_s": outcome.prepare_wait_s,
    }
