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
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eventstore import EventStore, open_store
from eventstore.events import Mode
from projections.base import fold
from projections.checkpoints import CheckpointsProjection, CheckpointState
from protocol.ids import Identifier
from protocol.streams import group_stream
from trainer.checkpoints import CheckpointOutcome, PreparedCheckpoint
from trainer.coordinator import RolloutCoordinator
from trainer.errors import AlreadyClaimed, ClaimWhilePrepared, InvalidRow
from trainer.gym import GymClient
from trainer.manifest import (
    CheckpointManifest,
    ManifestMismatch,
    check_manifest,
    config_fingerprint,
    hash_at,
    latest_step_dir,
    log_identity,
    read_manifest,
    write_manifest,
)
from trainer.ray_gym.results import ResultRules, row_result
from trainer.ray_gym.rows import (
    DEFAULT_GROUP_PREFIX,
    ROW_INDEX,
    CallBudgetSpent,
    GroupRecord,
    PlannedGroup,
    RowError,
    RowsDeadLettered,
    RowsLostToInfrastructure,
    call_digest,
    group_id,
    plan_call,
    read_group,
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
LEDGER_SECTION = "ledger"
# NeMo RL's `NemoGymConfig` is a TypedDict it owns: read by its keys, its other keys left to it.
NemoGymConfigLike = Mapping[str, Any]


class LedgerGymConfig(BaseModel):
    """The `ledger` section: where the log is, who the trainer is, how groups are driven, and how the
    Gym servers are reached (`agents` outright, a running Gym's `head_server_url`, or neither: they
    are started from `NemoGymConfig` as NeMo RL starts them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    db_url: str
    trainer_id: Identifier | None = None
    mode: Mode = "prompt_group"
    # Budgets: attempts per sibling, how long one attempt may run, how long one call waits for its groups.
    max_tries: int = Field(default=4, ge=1)
    max_infra_failures: int | None = Field(default=None, ge=1)
    max_data_failures: int | None = Field(default=None, ge=1)
    rollout_timeout_s: float = Field(default=600.0, gt=0)
    prepare_timeout_s: float = Field(default=300.0, gt=0)
    park_grace_s: float = Field(default=1.0, gt=0)
    call_budget_s: float = Field(default=6 * 3600.0, gt=0)
    # Rows per prompt group when a call holds several equal prompts side by side (rows.py).
    num_generations: int | None = Field(default=None, ge=1)
    group_prefix: str = DEFAULT_GROUP_PREFIX
    # Reaching the agents: outright (nothing started), or through a running Gym's head server.
    agents: dict[Identifier, str] = Field(default_factory=dict)
    head_server_url: str | None = None
    agent_token: str | None = None
    # Starting Gym: the interpreter that has nemo_gym (None: this one), the servers' working directory
    # (local server folders are found there first), the address the servers bind and advertise (None:
    # NeMo RL's, every interface for the head server and this node's address), the spin-up bound.
    gym_python: str | None = None
    gym_workdir: str | None = None
    gym_host: str | None = None
    gym_dotenv_path: str | None = None
    spinup_timeout_s: float = Field(default=900.0, gt=0)
    # Serve the log's figures on /metrics from inside the actor (the `metrics` extra); 0: a free port.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_addr: str = "127.0.0.1"
    # The trainer's checkpoints (NeMo RL's `checkpointing.checkpoint_dir`): at `_spinup` the log is
    # restored to the checkpoint NeMo RL loads from it (its newest `step_N`, by NeMo RL's own rule),
    # read from the manifest there.  `restore_checkpoint` names one outright instead (a checkpoint
    # directory, or the trainer's checkpoint name).  Neither: the log's newest cut of this trainer.
    checkpoint_dir: str | None = None
    restore_checkpoint: str | None = None

    def fingerprint(self) -> str:
        """What decides which groups a call's rows become and whose they are: a checkpoint saved
        under other values is refused at restore."""
        return config_fingerprint(
            {
                "trainer_id": self.trainer_id,
                "mode": self.mode,
                "group_prefix": self.group_prefix,
                "num_generations": self.num_generations,
            }
        )


def split_config(config: Any) -> tuple[dict[str, Any], LedgerGymConfig]:
    """(the NemoGymConfig, its `ledger` section) from what the actor was made with."""
    if isinstance(config, LedgerGymConfig):
        return {}, config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"LedgerGym takes a NemoGymConfig mapping or a LedgerGymConfig, not {type(config).__name__}"
        )
    cfg = dict(config)
    inner = dict(cfg.get("initial_global_config_dict") or {})
    section = cfg.pop(LEDGER_SECTION, None)
    if section is None:
        section = inner.pop(LEDGER_SECTION, None)
        if "initial_global_config_dict" in cfg:
            cfg["initial_global_config_dict"] = inner
    if section is None:
        if "db_url" in cfg:  # a LedgerGymConfig given as a plain dict
            return {}, _validated(cfg)
        raise ValueError(
            "LedgerGym needs a `ledger` section in its NemoGymConfig (env.nemo_gym.ledger: db_url, ...)"
        )
    return cfg, _validated(section)


def _validated(section: Any) -> LedgerGymConfig:
    try:
        return LedgerGymConfig.model_validate(dict(section))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "ledger"
        raise ValueError(f"ledger.{where}: {first['msg']}") from None


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
        occurrence, replay = await self._occurrence(digest, len(runs), call_id)
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
                order = [gid for gid in pending if self._settled(coord, gid)]
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
            items = await self._deliver(coord, group, train_step, call_id, tokenizer, deadline)
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

    # Checkpoints are named by the trainer (NeMo RL: `step_N`); the log's id is that name under the
    # trainer id (`<trainer_id>.step_N`), `.rK` added when the name was used before (a trainer that
    # restored to an older step saves the same step again): log ids are never reused.

    async def checkpoint(self, checkpoint_id: str, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """The one-call checkpoint: prepare, then commit (or the abort prepare ended in).  Only for a
        trainer that claims nothing between its own save and this call; otherwise prepare, save,
        commit."""
        coord = await self._coordinator()
        log_id = self._log_checkpoint_id(coord, checkpoint_id)
        outcome = await coord.checkpoint(log_id)
        return await self._bound(coord, log_id, checkpoint_id, outcome, checkpoint_dir)

    async def prepare_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """Split phase, first step, before the trainer saves: `{"prepared": True, ...}` once every
        agent is prepared (no claim is made from now to the decision: what the trainer saves is what
        the cut holds), else the aborted outcome.  Then `commit_checkpoint` (or `abort_checkpoint`)."""
        coord = await self._coordinator()
        log_id = self._log_checkpoint_id(coord, checkpoint_id)
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
        return {"prepared": False, **_outcome(result), "checkpoint_id": log_id}

    async def commit_checkpoint(
        self, checkpoint_id: str, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Commits the prepared checkpoint once the trainer saved, and binds it to the trainer's
        checkpoint directory (NeMo RL's `tmp_step_N`, before it is renamed `step_N`): the manifest
        is written there (`manifest` in the answer)."""
        coord = await self._coordinator()
        log_id = self._prepared.pop(checkpoint_id, checkpoint_id)
        outcome = await coord.commit_checkpoint(log_id)
        return await self._bound(coord, log_id, checkpoint_id, outcome, checkpoint_dir)

    async def abort_checkpoint(
        self, checkpoint_id: str, reason: str = "aborted by the trainer"
    ) -> dict[str, Any]:
        coord = await self._coordinator()
        log_id = self._prepared.pop(checkpoint_id, checkpoint_id)
        return {**_outcome(await coord.abort_checkpoint(log_id, reason)), "checkpoint_id": log_id}

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
                    restore_to = await asyncio.to_thread(self._restore_point, store) if restore else None
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

    def _restore_point(self, store: EventStore) -> str | None:
        """The log's checkpoint the trainer loaded: from the manifest of the directory named by
        `restore_checkpoint`, or of the one NeMo RL loads from `checkpoint_dir` (its newest
        `step_N`), checked against this log, trainer and settings; a name the log knows; or None (the
        trainer's newest cut in the log).  `ManifestMismatch` for what does not fit (one line)."""
        c = self.config
        projection = CheckpointsProjection()
        kinds = sorted(t.__name__ for t in projection.handles or ())
        checkpoints = fold(projection, store.read_all(0, types=kinds))
        mine = [k for k in checkpoints.checkpoints.values() if k.trainer_id == c.trainer_id]
        directory: Path | None = None
        if c.restore_checkpoint is not None:
            named = Path(c.restore_checkpoint)
            if not named.is_dir():
                return self._named_checkpoint(c.restore_checkpoint, mine)
            directory = named
        elif c.checkpoint_dir is not None:
            directory = latest_step_dir(Path(c.checkpoint_dir))
            if directory is None:
                committed = [k.checkpoint_id for k in mine if k.status in ("committed", "resumed")]
                if committed:
                    raise ManifestMismatch(
                        f"the trainer loaded no checkpoint ({c.checkpoint_dir} has no step_N), but the log "
                        f"holds {len(committed)} committed checkpoint(s) of trainer {c.trainer_id!r} "
                        f"(newest {committed[-1]}): a fresh run takes a new ledger.trainer_id or log"
                    )
                return None
        if directory is None:
            return None
        manifest = read_manifest(directory)
        check_manifest(
            manifest,
            identity=log_identity(store),
            cut_hash=hash_at(store, manifest.cut_position),
            trainer_id=c.trainer_id,
            fingerprint=c.fingerprint(),
            where=directory,
        )
        known = checkpoints.checkpoints.get(manifest.checkpoint_id)
        if known is not None and known.cut_position not in (None, manifest.cut_position):
            raise ManifestMismatch(
                f"{directory} names cut {manifest.cut_position} for checkpoint {manifest.checkpoint_id}, "
                f"the log's cut of it is {known.cut_position}"
            )
        return manifest.checkpoint_id

    def _named_checkpoint(self, name: str, mine: list[CheckpointState]) -> str:
        """The log's checkpoint a trainer's name (or the log's own id) stands for: its newest
        committed use."""
        base = self._base_id(name)
        uses = [k for k in mine if k.checkpoint_id in (name, base) or k.checkpoint_id.startswith(f"{base}.r")]
        committed = [k for k in uses if k.status in ("committed", "resumed") and k.cut_position is not None]
        if not committed:
            raise ManifestMismatch(
                f"ledger.restore_checkpoint {name!r} is no committed checkpoint of trainer "
                f"{self.config.trainer_id!r} in the log"
            )
        return max(committed, key=lambda k: k.cut_position or 0).checkpoint_id

    def _base_id(self, name: str) -> str:
        stem = Path(name).name.removeprefix("tmp_")
        trainer = self.config.trainer_id
        return f"{trainer}.{stem}" if trainer else stem

    def _log_checkpoint_id(self, coord: RolloutCoordinator, name: str) -> str:
        base = self._base_id(name)
        known = coord.checkpoints.checkpoints
        log_id, k = base, 0
        while log_id in known:
            k += 1
            log_id = f"{base}.r{k}"
        return log_id

    async def _bound(
        self,
        coord: RolloutCoordinator,
        log_id: str,
        name: str,
        outcome: CheckpointOutcome,
        checkpoint_dir: str | None,
    ) -> dict[str, Any]:
        """The outcome, with the manifest written into the trainer's directory when it committed."""
        answer = {**_outcome(outcome), "checkpoint_id": log_id}
        if not outcome.committed or checkpoint_dir is None or outcome.cut_position is None:
            return answer
        store = coord.store
        cut = outcome.cut_position

        def write() -> str:
            manifest = CheckpointManifest(
                checkpoint_id=log_id,
                trainer_checkpoint=Path(name).name.removeprefix("tmp_"),
                trainer_id=self.config.trainer_id,
                cut_position=cut,
                cut_hash=hash_at(store, cut),
                log_identity=log_identity(store),
                config_fingerprint=self.config.fingerprint(),
            )
            return str(write_manifest(Path(checkpoint_dir), manifest))

        answer["manifest"] = await coord.read_log(write, "binding the checkpoint to the trainer's")
        return answer

    def metrics_port(self) -> int | None:
        """The port `/metrics` is served on (after spin-up), if any."""
        return self._metrics.port if self._metrics is not None else None

    async def _records(self, gids: list[str]) -> dict[str, GroupRecord]:
        store, coord = self.store, self.coord
        assert store is not None and coord is not None
        # Through the journal: a database outage is ridden out as the coordinator's own reads are.
        return await coord.read_log(
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
    ) -> tuple[int, list[str]]:
        """The occurrence of these rows this call runs as, and the groups it delivers again first.

        Claims are read as the ledger stands them (a restore of the trainer rolls claims back; a
        restart of this actor alone does not).  The first occurrence that no other call has a
        standing claim on and that the ledger did not give up on (no group dead-lettered: NeMo RL's
        own retry of such rows is a new request) is resumed: its groups are submitted again
        (idempotent) and delivered, claimed again where a restore rolled their claims back.  One
        whose standing claims are all this very call's (`call_id`, a Ray task id the retries keep)
        is resumed whatever else holds: its first attempt delivered those groups, the retry yields
        them again first, in claim order (Ray drops what its caller has), then the rest."""
        coord = self.coord
        assert coord is not None
        prefix = self.config.group_prefix
        occurrence = 0
        while True:
            gids = [group_id(prefix, digest, occurrence, k) for k in range(groups)]
            known = [g for g in gids if coord.ledger.knows_group(g)]
            if not known:
                return occurrence, []
            records = await self._records(known)
            standing = [
                (position, call, gid)
                for gid, record in records.items()
                for position, call in record.claims
                if position in self._standing_claims(coord, gid)
            ]
            mine = call_id is not None and bool(standing) and all(c == call_id for _, c, _ in standing)
            foreign = any(call is None or call != call_id for _, call, _ in standing)
            given_up = any(r.dead_letter_reasons is not None for r in records.values())
            if mine or not (foreign or given_up):
                return occurrence, [gid for _, _, gid in sorted(standing)]
            occurrence += 1

    @staticmethod
    def _standing_claims(coord: RolloutCoordinator, gid: str) -> set[int]:
        group = coord.ledger.groups.get(gid) or coord.ledger.archived.get(gid)
        return {c.position for c in group.claims} if group is not None else set()

    @staticmethod
    def _settled(coord: RolloutCoordinator, gid: str) -> bool:
        group = coord.ledger.groups.get(gid)
        return (group.status != "open") if group is not None else gid in coord.ledger.archived

    async def _deliver(
        self,
        coord: RolloutCoordinator,
        group: PlannedGroup,
        train_step: int | None,
        call_id: str | None,
        tokenizer: Any,
        deadline: float,
    ) -> list[tuple[int, dict[str, Any]]]:
        """Claims the group (durably, before anything is yielded) and builds its rows' results."""
        [record] = (await self._records([group.group_id])).values()
        if record.dead_letter_reasons is not None:
            detail = (
                f"group {group.group_id} (rows {group.rows}) used up its {record.dead_letter_budget or 'retry'} "
                "budget: " + "; ".join(record.dead_letter_reasons[:5])
            )
            raise (
                RowsDeadLettered(detail)
                if record.dead_letter_budget == "data"
                else RowsLostToInfrastructure(detail)
            )
        if not record.sealed or len(record.seals) != len(group.rows):
            raise RowError(f"group {group.group_id} left play without a seal of every row")
        while True:
            try:
                await coord.claim_for_training(group.group_id, train_step, call_id=call_id)
                break
            except AlreadyClaimed:
                break  # a retry replaying what its first attempt claimed
            except ClaimWhilePrepared:
                # The trainer is saving a checkpoint: the group goes out once it is decided, so that
                # what it saves and the cut hold the same claims.
                left = deadline - time.monotonic()
                if left <= 0 or not await coord.wait_checkpoint_decided(left):
                    raise CallBudgetSpent(
                        f"group {group.group_id} waited for checkpoint {coord.active_checkpoint!r} "
                        f"to be decided until the call's budget ({self.config.call_budget_s:g} s) ran out"
                    ) from None

        seals = [record.seals[gi] for gi in range(len(group.rows))]
        for gi, seal in enumerate(seals):
            if seal.reply is None:
                raise RowError(f"group {group.group_id}: sibling {gi}'s reply was not kept")
        read = await coord.read_payloads([(seal.reply, seal.tokens) for seal in seals])
        out = []
        for gi, rowidx in enumerate(group.rows):
            seal = seals[gi]
            reply, arrays = read[gi]
            assert reply is not None and arrays is not None
            result = row_result(
                group.row_dicts[gi],
                reply,
                arrays,
                rollout_id=seal.rollout_id,
                attempt_index=seal.attempt_index,
                mask_sample=seal.mask_sample,
                rules=self.rules,
                tokenizer=tokenizer,
            )
            out.append((rowidx, result))
        return out


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


def _outcome(outcome: CheckpointOutcome) -> dict[str, Any]:
    """A decided checkpoint as the actor answers it (plain data across the Ray boundary)."""
    return {
        "committed": outcome.committed,
        "reason": outcome.reason,
        "prepare_wait_s": outcome.prepare_wait_s,
        "cut_position": outcome.cut_position,
    }
