"""`LedgerGym`: NeMo RL's `NemoGym` Ray actor with the coordinator and its log inside.

    from trainer.ray_gym import LedgerGym, ledger_gym_actor
    gym = ledger_gym_actor().remote(nemo_gym_config)   # NeMo RL's NemoGymConfig + a `ledger` section
    ray.get(gym._spinup.remote())                      # starts (or finds) the Gym servers
    async for ref in gym.run_rollouts.options(num_returns="streaming").remote(rows, "timing/rollout"):
        rowidx, result, timing = await ref

The configuration is NeMo RL's own `NemoGymConfig` (`model_name`, `base_urls`,
`initial_global_config_dict`, the detection and router-replay knobs), with one `ledger` section,
either at its top level or inside `initial_global_config_dict` (where NeMo RL puts whatever
`env.nemo_gym` holds beyond its own keys): see `LedgerGymConfig`.  A bare `LedgerGymConfig` (agents
given by URL) is accepted too.

The surface is `NemoGym`'s on both NeMo RL versions: `_spinup`, `set_tokenizer` (main),
`run_rollouts(examples, timer_prefix, deduplicate_multimodal_data)` (main) and
`run_rollouts(examples, tokenizer, timer_prefix, deduplicate_multimodal_data)` (the recovery
branch: the tokenizer positional), `health_check`, `shutdown`; plus the ledger's checkpoints, metrics
and logprobs.

NeMo RL's actor is `@ray.remote(max_restarts=-1, max_task_retries=-1)`: Ray restarts a dead actor
(its constructor runs again; NeMo RL does not call `_spinup` again) and calls a task that was in
flight again with the same arguments.  Here that is safe by construction:

- every call spins up what is missing (the log, the coordinator recovered from it, the Gym servers);
- a retried `run_rollouts` plans the same group ids from the same rows and `submit` is idempotent,
  so it resumes the groups instead of running them again (see rows.py for occurrences);
- each group is claimed (an append) before its rows are yielded, and a retried stream first yields
  again, in claim order, the groups the first attempt claimed: Ray replays a streaming generator and
  drops the items its caller already has by index, so the replay must yield the same items in the
  same order, and the log's claim order is that order.

Results come in completion order of groups (rows of a group in generation order).  A call ends with
an error of the class NeMo RL's `classify_rollout_failure` handles for it (rows.py): a group out of
data budget `RowsDeadLettered` (data), out of infrastructure budget `RowsLostToInfrastructure`
(infra), a call past `call_budget_s` `CallBudgetSpent` (infra, a `TimeoutError`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import tempfile
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from eventstore import EventStore, open_store
from trainer.checkpoints import PreparedCheckpoint
from trainer.coordinator import RolloutCoordinator
from trainer.errors import InvalidRow
from trainer.gym import GymClient
from trainer.ray_gym import checkpoints, delivery
from trainer.ray_gym.config import LedgerGymConfig, NemoGymConfigLike, split_config
from trainer.ray_gym.results import ResultRules
from trainer.ray_gym.rows import (
    ROW_INDEX,
    CallBudgetSpent,
    RowError,
    call_digest,
    plan_call,
    row_payload,
    split_groups,
)
from trainer.ray_gym.spinup import (
    GymHost,
    SpinupError,
    agents_of,
    global_config_for,
    read_global_config,
    start_gym,
)
from trainer.rows import check_row
from trainer.settings import log

# NeMo RL's own actor options: restart for ever, retry a task in flight for ever.
ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": -1, "max_task_retries": -1}
# The longest an actor that is asked to stop spends closing its coordinator at exit (inside the usual
# 30 s a supervisor waits between SIGTERM and SIGKILL).
EXIT_BUDGET_S = 20.0


def _call_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str, bool]:
    """(tokenizer, timer_prefix, deduplicate_multimodal_data) as either NeMo RL version passes them:
    main `(rows, timer_prefix, dedup)`, the recovery branch `(rows, tokenizer, timer_prefix, dedup)`."""
    rest = list(args)
    tokenizer = kwargs.pop("tokenizer", None)
    if rest and not isinstance(rest[0], str):
        tokenizer = rest.pop(0)
    timer_prefix = kwargs.pop("timer_prefix", rest.pop(0) if rest else "timing/rollout")
    dedup = kwargs.pop("deduplicate_multimodal_data", rest.pop(0) if rest else False)
    if rest or kwargs:
        raise TypeError(f"run_rollouts got unexpected arguments: {rest or sorted(kwargs)}")
    if not isinstance(timer_prefix, str):
        raise TypeError(f"run_rollouts: timer_prefix must be a str, not {type(timer_prefix).__name__}")
    return tokenizer, timer_prefix, bool(dedup)


class LedgerGym:
    """The actor's body (plain Python: usable, and tested, without Ray as well)."""

    def __init__(self, config: NemoGymConfigLike | LedgerGymConfig) -> None:
        self.cfg, self.config = split_config(config)
        if (self.cfg.get("token_capture") or {}).get("enabled"):
            raise ValueError(
                "token_capture.enabled: the ledger keeps every attempt's token records itself and returns "
                "them in message_log; turn NeMo RL's token capture off with LedgerGym"
            )
        self.rules = ResultRules.of(self.cfg)
        self.store: EventStore | None = None
        self.coord: RolloutCoordinator | None = None
        self.clients: dict[str, GymClient] = {}
        self.gym: GymHost | None = None
        self.agent_urls: dict[str, str] = dict(self.config.agents)
        self._tokenizer: Any = None
        self._prepared: dict[str, str] = {}  # the trainer's checkpoint name -> the log's id, while prepared
        self._lock: asyncio.Lock | None = None
        self._metrics: Any = None
        self._exit_hook: Any = None

    # --- NeMo RL's actor surface ----------------------------------------------------------------

    async def _spinup(self) -> None:
        """The trainer's start (NeMo RL calls it once, from its setup): starts or finds the Gym
        servers, opens the log and restores it to the checkpoint the trainer loaded (see
        `checkpoint_dir`): claims after its cut roll back.  An actor Ray restarted is not spun up
        again; its first call recovers the coordinator keeping every claim (the trainer kept its
        state)."""
        await self._coordinator(restore=True)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """NeMo RL main installs its tokenizer once here; results then carry the decoded strings."""
        self._tokenizer = tokenizer

    async def health_check(self) -> None:
        """Raises if a Gym server died, the coordinator failed, or the log stopped it."""
        coord = await self._coordinator()
        if self.gym is not None and not self.gym.alive():
            raise SpinupError(
                f"the Gym servers stopped (log {self.gym.log_path}): {self.gym.log_tail(300)!r}"
            )
        if coord.errors:
            raise coord.errors[0]
        if coord.stopped is not None:
            raise coord.stopped

    async def run_rollouts(
        self,
        nemo_gym_examples: list[dict[str, Any]],
        *args: Any,
        train_step: int | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[tuple[int, dict[str, Any], dict[str, float] | None], None]:
        """Streams `(rowidx, result, timing)` as groups seal; see the module doc for retries."""
        tokenizer, timer_prefix, _dedup = _call_arguments(args, kwargs)
        tokenizer = tokenizer if tokenizer is not None else self._tokenizer
        started = time.monotonic()
        coord = await self._coordinator()
        rows = nemo_gym_examples
        runs = split_groups(rows, self.config.num_generations)
        for run in runs:
            agent = run[0]["agent_ref"]["name"]
            if agent not in coord.agent_names:
                raise RowError(f"row {run[0]['_rowidx']} names agent {agent!r}, which the Gym does not run")
        for run in runs:  # every prompt, before its digest or any group: a bad one refuses the call
            try:
                check_row(row_payload(run[0]), f"row {run[0][ROW_INDEX]}")
            except InvalidRow as exc:
                raise RowError(str(exc)) from None
        call_id = self._call_id()
        digest = call_digest(rows)
        occurrence, replay = await delivery.occurrence(self.config, coord, digest, len(runs), call_id)
        planned = plan_call(runs, digest, occurrence, self.config.group_prefix)
        for p in planned:
            await coord.submit(
                p.group_id, p.prompt_ref, p.agent_name, len(p.rows), p.payload, mode=self.config.mode
            )
        pending = {p.group_id: p for p in planned}
        total, sent = len(rows), 0
        waited = built = 0.0
        # A retry: what the first attempt delivered, again, in the order the log says it went out.
        order = list(replay)
        deadline = started + self.config.call_budget_s
        while pending:
            if not order:
                order = [gid for gid in pending if delivery.settled(coord, gid)]
            if not order:
                if coord.errors:
                    raise coord.errors[0]
                if time.monotonic() > deadline:
                    raise CallBudgetSpent(
                        f"{len(pending)} group(s) of this call still open after {self.config.call_budget_s:g} s"
                    )
                mark = time.monotonic()
                await coord.wait_changed(0.5)
                waited += time.monotonic() - mark
                continue
            gid = order.pop(0)
            group = pending.pop(gid)
            mark = time.monotonic()
            items = await delivery.deliver(
                self.config, self.rules, coord, group, train_step, call_id, tokenizer, deadline
            )
            built += time.monotonic() - mark
            for rowidx, result in items:
                sent += 1
                timing = None
                if sent == total:
                    total_s = time.monotonic() - started
                    timing = {
                        f"{timer_prefix}/await_results": waited,
                        f"{timer_prefix}/postprocess_results": built,
                        f"{timer_prefix}/postprocess_results_pct": 100 * built / total_s if total_s else 0.0,
                        f"{timer_prefix}/ledger_total_s": total_s,
                    }
                yield rowidx, result, timing

    async def checkpoint(self, checkpoint_id: str, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """The one-call checkpoint: prepare, then commit (or the abort prepare ended in).  Only for a
        trainer that claims nothing between its own save and this call; otherwise prepare, save,
        commit."""
        coord = await self._coordinator()
        log_id = checkpoints.log_checkpoint_id(self.config, coord, checkpoint_id)
        outcome = await coord.checkpoint(log_id)
        return await checkpoints.bound(self.config, coord, log_id, checkpoint_id, outcome, checkpoint_dir)

    async def prepare_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """Split phase, first step, before the trainer saves: `{"prepared": True, ...}` once every
        agent is prepared (no claim is made from now to the decision: what the trainer saves is what
        the cut holds), else the aborted outcome.  Then `commit_checkpoint` (or `abort_checkpoint`)."""
        coord = await self._coordinator()
        log_id = checkpoints.log_checkpoint_id(self.config, coord, checkpoint_id)
        self._prepared[checkpoint_id] = log_id
        result = await coord.prepare_checkpoint(log_id)
        if isinstance(result, PreparedCheckpoint):
            return {
                "prepared": True,
                "committed": False,
                "reason": "",
                "prepare_wait_s": result.prepare_wait_s,
                "checkpoint_id": log_id,
            }
        self._prepared.pop(checkpoint_id, None)
        return {"prepared": False, **checkpoints.outcome_of(result), "checkpoint_id": log_id}

    async def commit_checkpoint(
        self, checkpoint_id: str, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Commits the prepared checkpoint once the trainer saved, and binds it to the trainer's
        checkpoint directory (NeMo RL's `tmp_step_N`, before it is renamed `step_N`): the manifest
        is written there (`manifest` in the answer)."""
        coord = await self._coordinator()
        log_id = self._prepared.pop(checkpoint_id, checkpoint_id)
        outcome = await coord.commit_checkpoint(log_id)
        return await checkpoints.bound(self.config, coord, log_id, checkpoint_id, outcome, checkpoint_dir)

    async def abort_checkpoint(
        self, checkpoint_id: str, reason: str = "aborted by the trainer"
    ) -> dict[str, Any]:
        coord = await self._coordinator()
        log_id = self._prepared.pop(checkpoint_id, checkpoint_id)
        return {
            **checkpoints.outcome_of(await coord.abort_checkpoint(log_id, reason)),
            "checkpoint_id": log_id,
        }

    async def record_logprobs(
        self, rollout_id: str, attempt_index: int, logprobs: list[float], policy_version: str
    ) -> bool:
        """NeMo RL's `prev_logprobs` of one row (`full_result["_ledger_rollout_id"]`,
        `["_ledger_attempt_index"]`) recorded as its `LogprobsComputed`; see
        `RolloutCoordinator.record_logprobs`."""
        coord = await self._coordinator()
        return await coord.record_logprobs(rollout_id, attempt_index, logprobs, policy_version)

    async def metrics(self) -> dict[str, float]:
        return await (await self._coordinator()).metrics()

    async def wait_idle(self, timeout_s: float = 60.0) -> None:
        await (await self._coordinator()).wait_idle(timeout_s)

    async def shutdown(self) -> None:
        """Stops everything this actor started; safe on an actor that never spun up (NeMo RL calls it
        in a `finally`)."""
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.coord is not None:
            await self.coord.close()
            await self.coord.drain()
            self.coord = None
        for client in self.clients.values():
            await client.aclose()
        self.clients = {}
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None
        if self.gym is not None:
            await self.gym.stop()
            self.gym = None

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

    async def _find_agents(self) -> dict[str, str]:
        c = self.config
        if c.agents:
            return dict(c.agents)
        if c.head_server_url is None:
            self.gym = await self._start_gym()
        head = c.head_server_url or (self.gym.head_server_url if self.gym else "")
        found = agents_of(await read_global_config(head))
        if not found:
            raise SpinupError(f"the Gym at {head} runs no responses_api_agents server")
        return found

    async def _start_gym(self) -> GymHost:
        if "model_name" not in self.cfg or "base_urls" not in self.cfg:
            raise SpinupError(
                "LedgerGym starts the Gym servers from NemoGymConfig's model_name and base_urls (or set "
                "ledger.agents / ledger.head_server_url to use servers already running)"
            )
        c = self.config
        ray_address, node_ip = _ray_cluster()
        # NeMo RL's choices unless told: the head server on every interface, servers at this node's IP.
        host = c.gym_host or node_ip or "127.0.0.1"
        bind = c.gym_host or "0.0.0.0"
        # Gym joins the actor's Ray cluster only from the same interpreter (Ray needs one Python).
        same_python = c.gym_python is None or os.path.realpath(c.gym_python) == os.path.realpath(_python())
        config = global_config_for(
            self.cfg, host=host, bind_host=bind, ray_address=ray_address if same_python else None
        )
        from trainer.ray_gym.local import LOOPBACK_ENV

        env = {LOOPBACK_ENV: "0"} if host in ("127.0.0.1", "localhost") else {}
        return await start_gym(
            config,
            python=c.gym_python,
            workdir=c.gym_workdir,
            connect_host="127.0.0.1" if bind in ("0.0.0.0", "127.0.0.1") else bind,
            log_dir=Path(tempfile.gettempdir()) / "ledger-gym",
            env=env,
            timeout_s=c.spinup_timeout_s,
            dotenv_path=c.gym_dotenv_path,
        )

    async def _coordinator(self, *, restore: bool = False) -> RolloutCoordinator:
        """The coordinator, recovered from the log on first use: restored to the trainer's checkpoint
        when the trainer starts (`restore`, from `_spinup`), else keeping every claim."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.coord is None:
                c = self.config
                if not self.agent_urls or (self.gym is not None and not self.gym.alive()):
                    if self.gym is not None:
                        await self.gym.stop()
                        self.gym = None
                    self.agent_urls = await self._find_agents()
                store = self.store = await asyncio.to_thread(open_store, c.db_url, migrate_schema=True)
                self.clients = {
                    name: GymClient(url, name, token=c.agent_token) for name, url in self.agent_urls.items()
                }
                self._close_at_exit(asyncio.get_running_loop())
                try:
                    restore_to = (
                        await asyncio.to_thread(checkpoints.restore_point, c, store) if restore else None
                    )
                    self.coord = await RolloutCoordinator.recover(
                        store,
                        self.clients,
                        restore_to=restore_to,
                        claims_kept=not restore,
                        mode=c.mode,
                        rollout_timeout_s=c.rollout_timeout_s,
                        prepare_timeout_s=c.prepare_timeout_s,
                        park_grace_s=c.park_grace_s,
                        max_tries=c.max_tries,
                        max_infra_failures=c.max_infra_failures,
                        max_data_failures=c.max_data_failures,
                        trainer_id=c.trainer_id,
                    )
                except BaseException:
                    # A refused restore (or a failed one) leaves nothing open: the call can be made again.
                    for client in self.clients.values():
                        await client.aclose()
                    self.clients, self.store = {}, None
                    if self._exit_hook is not None:
                        atexit.unregister(self._exit_hook)
                        self._exit_hook = None
                    await asyncio.to_thread(store.close)
                    raise
                if c.metrics_port is not None and self._metrics is None:
                    from projections.exporter import serve_metrics
                    from trainer.telemetry import journal_families

                    self._metrics = serve_metrics(
                        self.store, c.metrics_port, [journal_families], c.metrics_addr
                    )
            return self.coord

    def _call_id(self) -> str | None:
        """The Ray task this call runs as: the same on every retry of it (None outside a Ray actor)."""
        return delivery.call_id()

    def metrics_port(self) -> int | None:
        """The port `/metrics` is served on (after spin-up), if any."""
        return self._metrics.port if self._metrics is not None else None


def _python() -> str:
    import sys

    return sys.executable


def _ray_cluster() -> tuple[str | None, str | None]:
    """(the GCS address, this node's IP) of the Ray this actor runs in, or (None, None)."""
    try:
        import ray
    except ImportError:
        return None, None
    if not ray.is_initialized():
        return None, None
    return str(ray.get_runtime_context().gcs_address), str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


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
