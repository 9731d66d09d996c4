"""The agents this coordinator drives: their clients, binding to this trainer, identity and incarnations,
and the loop that keeps each agent's checkpoint phase in line with the log.

One trainer per agent (participant.driver): `bind` claims every reachable agent for this trainer at
start, or refuses the start with `AgentShared` before anything is written; an agent away then is
bound by its first call.  `release` frees them at close.  An agent's identity (`/health`'s name) must be
the one the coordinator calls it: its receipts are owed to that name.  A change of its incarnation is a
restart, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, ItemsView, Iterable

from projections.ownership import Driver
from trainer.core.refusal import driven, on_trainer_conflict, refusal_line
from trainer.errors import AgentShared, CoordinatorStopped, FencedOff
from trainer.gate import Gate
from trainer.gym import GymClient
from trainer.gym.errors import AgentIdentityError, GymError, TrainerConflictError
from trainer.settings import Settings, log
from trainer.stops import log_stop

# How long `release()` waits for the agents to answer the release of their binding.
RELEASE_TIMEOUT_S = 5.0

Reconcile = Callable[[str, GymClient], Awaitable[None]]


class Agents:
    def __init__(
        self, clients: dict[str, GymClient], settings: Settings, gate: Gate, errors: list[BaseException]
    ) -> None:
        self._clients = dict(clients)
        self.settings = settings
        self.gate = gate
        # The coordinator's errors (an agent found to be another one is reported there).
        self.errors = errors
        # Each agent's incarnation as last seen (at start and at each reconcile): a change is a restart.
        self.incarnations: dict[str, str] = {}
        # The agents that refused this trainer at a call after its start (trainer.core.refusal): name ->
        # the error, not driven since.
        self.refused: dict[str, AgentShared] = {}
        self._reconciler: asyncio.Task[None] | None = None

    def refuse(self, agent_name: str, message: str) -> AgentShared:
        """`agent_name` answered `409 trainer_conflict`: it is not driven from now on, and the refusal
        is reported once (in the coordinator's errors and the log); returns the error to raise."""
        decided = on_trainer_conflict(self.refused, agent_name, self.client(agent_name).base_url, message)
        if decided.first:
            error = self.refused[agent_name] = AgentShared(decided.line)
            self.errors.append(error)
            log.error("agent %s is not driven any more: %s", agent_name, decided.line)
        return self.refused[agent_name]

    # --- who they are ------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self._clients)

    def items(self) -> ItemsView[str, GymClient]:
        return self._clients.items()

    def values(self) -> Iterable[GymClient]:
        return self._clients.values()

    def __contains__(self, name: object) -> bool:
        return name in self._clients

    def get(self, name: str) -> GymClient | None:
        return self._clients.get(name)

    def client(self, name: str) -> GymClient:
        try:
            return self._clients[name]
        except KeyError:
            raise KeyError(f"no client for agent {name!r}; known: {sorted(self._clients)}") from None

    @property
    def driver(self) -> Driver:
        """This coordinator as the log sees it: its trainer and the agents it drives (every act at an
        agent on an attempt or debt is checked against it: projections.ownership)."""
        return Driver.of(self.settings.trainer_id, driven(self._clients, self.refused))

    def waiting_runs(self) -> int:
        """Attempts waiting for a connection of their agent's run pool (`max_run_connections`)."""
        return sum(client.runs_waiting for client in self._clients.values())

    # --- life -----------------------------------------------------------------------------------------

    async def connect(self) -> None:
        """What each agent supports (a plain Gym agent is driven in reduced mode) and who it is, then
        bound to this trainer: an agent another trainer drives refuses the start here, with nothing in
        the log."""
        await asyncio.gather(*(client.connect_quietly() for client in self._clients.values()))
        me = self.settings.trainer_id
        for name, client in sorted(self._clients.items()):
            client.drive_as(me)
            if client.capabilities_seen is None:
                continue  # away now (connect_quietly said nothing): bound by its first call
            try:
                await client.bind_driver(me)
            except TrainerConflictError as exc:
                raise AgentShared(refusal_line(client.base_url, exc.message)) from None
            except GymError as exc:
                log.warning("agent %s not bound at start (bound at its first call): %s", name, exc)

    async def check_identities(self) -> None:
        """Each agent must be who the coordinator calls it; its incarnation is recorded (a later change
        is a restart).  An agent away now is checked at the next reconcile."""
        for name, client in sorted(self._clients.items()):
            try:
                health = await client.health()
            except GymError as exc:
                log.warning("agent %s not reachable at start (identity checked later): %s", name, exc)
                continue
            if health.agent_name != name:
                raise AgentIdentityError(
                    f"the agent at {client.base_url} is {health.agent_name!r}, not {name!r}: fix the "
                    "coordinator's agents mapping (its receipts would be owed to the wrong agent)"
                )
            self.incarnations[name] = health.execution_incarnation

    async def check_identity(self, name: str, client: GymClient) -> bool:
        """The agent behind `client` is still `name` (a reconnect may reach another process); a new
        incarnation (it restarted) is recorded.  False when it cannot be driven now."""
        try:
            health = await client.health()
        except GymError as exc:
            log.info("agent %s unreachable: %s", name, exc)
            return False
        if health.agent_name != name:
            error = AgentIdentityError(
                f"the agent at {client.base_url} is now {health.agent_name!r}, not {name!r}: not driven "
                "until it is (its receipts would be owed to the wrong agent)"
            )
            log.error("%s", error)
            if not any(isinstance(e, AgentIdentityError) and str(e) == str(error) for e in self.errors):
                self.errors.append(error)
            return False
        known = self.incarnations.get(name)
        if known is not None and health.execution_incarnation != known:
            log.warning(
                "agent %s restarted: incarnation %s -> %s (generation %d)",
                name,
                known,
                health.execution_incarnation,
                health.execution_generation,
            )
        self.incarnations[name] = health.execution_incarnation
        return True

    async def release(self) -> None:
        """At close: each agent that holds nothing of this trainer any more is free for another one."""
        me = self.settings.trainer_id

        async def release(name: str, client: GymClient) -> None:
            try:
                await client.release_driver(me)
            except GymError as exc:
                log.info("agent %s: binding not released at close (kept for this trainer): %s", name, exc)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await asyncio.gather(
                    *(release(n, c) for n, c in self._clients.items() if n not in self.refused)
                )

    # --- reconciling ----------------------------------------------------------------------------------

    def start_reconciling(self, reconcile: Reconcile, answered: Callable[[str], None]) -> None:
        """Compares each agent's checkpoint phase with the log every `reconcile_every_s` (0: never)."""
        if self.settings.reconcile_every_s > 0 and self._reconciler is None:
            self._reconciler = asyncio.create_task(
                self._reconcile_loop(reconcile, answered), name="reconcile"
            )

    async def stop_reconciling(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(BaseException):
                await self._reconciler

    async def _reconcile_loop(self, reconcile: Reconcile, answered: Callable[[str], None]) -> None:
        """An agent's checkpoint phase is compared with the log continuously, not only at recovery:
        an agent left preparing or paused by a checkpoint nobody drives any more (its coordinator
        died, an abort never reached it) is brought to the log's decision."""
        every = self.settings.reconcile_every_s
        while not self.gate.closing:
            await asyncio.sleep(every)
            for name, client in sorted(self._clients.items()):
                if self.gate.in_flight or self.gate.closing:
                    break
                if name in self.refused:  # another trainer's agent (trainer.core.refusal)
                    continue
                try:
                    if not await self.check_identity(name, client):
                        continue
                    answered(name)
                    await reconcile(name, client)
                except (FencedOff, CoordinatorStopped) as exc:
                    log_stop("reconciliation", exc)
                    return
                except Exception:
                    log.exception("reconciling %s failed; tried again in %.1f s", name, every)
