"""The console's web application: FastAPI routes over the live fold, Jinja2 pages, htmx for the rest.

Every route is a GET (the guard answers anything else 405) and every page is rendered on the server
from the fold (`console._fold`, held still under its lock while a page reads it) and from the log's
own indexes (`console._reads`).  The overview is pushed as server-sent events whenever the follower
folded a page (`/live`, read by htmx's SSE extension), at most `PUSHES_PER_S` times a second and at
least every `HEARTBEAT_S` (so the ages on it move while the log is quiet).  Templates escape every
value they are given (Jinja2's autoescape); the pictures made in Python escape their own
(`projections.swimlane`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Final
from urllib.parse import quote, urlencode

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse
from starlette.staticfiles import StaticFiles

from console._checkpoints import PER_PAGE as CHECKPOINTS_PER_PAGE
from console._checkpoints import (
    WINDOW_EVENTS,
    WINDOW_TYPES,
    checkpoint_detail,
    list_checkpoints,
)
from console._groups import (
    PER_PAGE,
    group_summary,
    list_groups,
    parse_filter,
    step_groups,
    train_steps,
)
from console._guard import ConsoleGuard
from console._jobs import KINDS, Jobs, Kind
from console._live import Live
from console._overview import Overview, Verdict, build_overview, debt_group, wanted
from console._reads import event_at, events_between, first_position_at, recorded_at, rollout_events
from console._rollout import payloads_view, rollout_view
from eventstore import EventStore
from eventstore.events import AckOwed
from eventstore.payload_stores import payload_plane
from projections.base import ReplayRefused, decode
from projections.runner import RUNNER_NAME
from projections.swimlane import SWIMLANE_CSS, render_svg
from projections.timeline import describe
from protocol.ids import group_id_of
from protocol.streams import checkpoint_stream, group_stream

# Zoom levels of a rollout's swimlane: None is the fitted picture (waits by their logarithm).
ZOOMS: Final[dict[str, float | None]] = {"fit": None, "10": 10.0, "100": 100.0, "1000": 1000.0}
PUSHES_PER_S: Final = 4.0
HEARTBEAT_S: Final = 5.0
# Server-sent event streams open at once; more get 503 (each holds a connection and a task).
MAX_STREAMS: Final = 64
# Times and debt times remembered (positions the overview and the lists look up again and again).
CACHED: Final = 10_000


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    """What `ledger console` was given."""

    url: str  # the log, resolved (the auditor role's URL when there is one)
    payloads: str | None = None
    token: str | None = None
    poll_interval_s: float = 0.1
    check_budget_s: float = 1800.0
    title: str = ""


class _Lru:
    """A bounded map, safe to share between the threads that serve pages."""

    def __init__(self) -> None:
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            return self._items.get(key, default)

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._items

    def remember(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > CACHED:
                self._items.popitem(last=False)


def _utc(ts: float | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _segment(value: Any) -> str:
    """One path segment, quoted whole (an id never becomes a path of its own)."""
    return quote(str(value), safe="")


def _int(value: str | None, default: int) -> int | None:
    """A whole number from a query or a path, `default` when none is given, None when it is not one."""
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        return None


def _query(params: Mapping[str, Any], **changes: Any) -> str:
    merged = {k: v for k, v in {**params, **changes}.items() if v not in (None, "")}
    return urlencode(merged)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["utc"] = _utc
    env.filters["seconds"] = _seconds
    env.filters["seg"] = _segment
    env.filters["num"] = lambda n: f"{n:,}" if isinstance(n, int) else n
    env.globals["query"] = _query
    return env


class Console:
    """The console's shell: the store, the follower, the checks, and the reads each page makes."""

    def __init__(self, store: EventStore, config: ConsoleConfig) -> None:
        self.store = store
        self.config = config
        self.live = Live(store, poll_interval_s=config.poll_interval_s)
        self.jobs = Jobs(config.url, config.payloads, self.live.changes.bump, config.check_budget_s)
        self.env = _environment()
        self._times: _Lru = _Lru()
        self._debt_times: _Lru = _Lru()
        self._runner: tuple[float, int | None] = (0.0, None)
        self._rendered: tuple[tuple[int, int], str] | None = None
        self.streams = 0
        self.closing = asyncio.Event()

    # --- the shell's reads -----------------------------------------------------------------

    def times(self, positions: set[int] | frozenset[int]) -> dict[int, float]:
        found = {p: self._times.get(p) for p in positions}
        missing = [p for p, t in found.items() if t is None]
        if missing:
            for p, t in recorded_at(self.store, missing).items():
                self._times.remember(p, t)
                found[p] = t
        return {p: t for p, t in found.items() if t is not None}

    def _debt_recorded(self, key: str) -> float | None:
        """When the AckOwed of debt `key` was recorded (read from its group's stream once)."""
        if key in self._debt_times:
            known: float | None = self._debt_times.get(key)
            return known
        rollout_id, _, attempt = key.rpartition("/")
        found = None
        for event in self.store.read_stream(group_stream(debt_group(key))):
            if event.type != AckOwed.event_type():
                continue
            receipt = event.data.get("receipt") or {}
            if receipt.get("rollout_id") == rollout_id and str(receipt.get("attempt_index")) == attempt:
                found = event.recorded_at
        self._debt_times.remember(key, found)
        return found

    def runner_position(self) -> int | None:
        at, position = self._runner
        if time.monotonic() - at > 1.0:
            position = self.store.subscriber_position(RUNNER_NAME)
            self._runner = (time.monotonic(), position)
        return position

    def verdict(self, kind: Kind) -> Verdict | None:
        last = self.jobs.last(kind)
        return None if last is None else Verdict(last.ok, last.summary, last.finished_at)

    def overview(self) -> Overview | None:
        with self.live.state() as fold:
            if fold is None:
                return None
            want = wanted(fold)
        times = self.times(want.positions)
        debts = {key: self._debt_recorded(key) for key in want.debts}
        runner = self.runner_position()
        progress = self.live.progress()
        with self.live.state() as fold:
            assert fold is not None
            for key, at in debts.items():
                if at is not None and any(key in owed for owed in fold.ledger.debts.values()):
                    fold.owed_at[key] = at
            return build_overview(
                fold,
                phase=progress.phase,
                target=progress.target,
                note=progress.note,
                times=times,
                runner_position=runner,
                audit=self.verdict("audit"),
                verify=self.verdict("verify"),
                now=time.time(),
            )

    def overview_html(self) -> str:
        """The overview fragment; rendered once per (version, second) whoever asks."""
        key = (self.live.changes.version, int(time.time()))
        cached = self._rendered
        if cached is not None and cached[0] == key:
            return cached[1]
        html = self.render(
            "_overview.html",
            ov=self.overview(),
            progress=self.live.progress(),
            running={k: self.jobs.running(k) for k in KINDS},
        )
        self._rendered = (key, html)
        return html

    def render(self, template: str, **values: Any) -> str:
        return self.env.get_template(template).render(
            now=time.time(), title=self.config.title or self.store.url, **values
        )

    def page(self, template: str, status_code: int = 200, **values: Any) -> HTMLResponse:
        return HTMLResponse(
            self.render(template, **values), status_code=status_code, headers={"cache-control": "no-store"}
        )

    def not_found(self, what: str) -> HTMLResponse:
        return self.page("not_found.html", status_code=404, what=what)


def create_app(store: EventStore, config: ConsoleConfig) -> tuple[ConsoleGuard, Console]:
    """The application (behind its guard) and its shell; the shell's follower starts with the app."""
    shell = Console(store, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        shell.live.start()
        try:
            yield
        finally:
            shell.closing.set()
            shell.jobs.close()
            await run_in_threadpool(shell.live.stop)

    app = FastAPI(title="ledger console", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def no_such_page(request: Request, exc: StarletteHTTPException) -> Response:
        # A path no route takes (an id with a slash in it, say) gets the console's own page, which
        # shows the path as text.
        if exc.status_code == 404:
            return shell.not_found(f"page {request.scope['path']}")
        return PlainTextResponse(str(exc.detail), status_code=exc.status_code)

    app.mount("/static", StaticFiles(directory=str(files("console") / "static")), name="static")
    _routes(app, shell)
    return ConsoleGuard(app, token=config.token), shell


def _routes(app: FastAPI, c: Console) -> None:
    @app.get("/health", response_class=PlainTextResponse)
    def health() -> str:
        return "ok"

    @app.get("/swimlane.css")
    def swimlane_css() -> Response:
        return Response(SWIMLANE_CSS, media_type="text/css", headers={"cache-control": "max-age=3600"})

    @app.get("/", response_class=HTMLResponse)
    def overview_page() -> HTMLResponse:
        return c.page("overview.html", fragment=c.overview_html())

    @app.get("/overview", response_class=HTMLResponse)
    def overview_fragment() -> HTMLResponse:
        return HTMLResponse(c.overview_html(), headers={"cache-control": "no-store"})

    @app.get("/live")
    async def live() -> Response:
        if c.streams >= MAX_STREAMS:
            return PlainTextResponse("too many live pages open", status_code=503)

        async def events() -> AsyncIterator[str]:
            c.streams += 1
            try:
                seen = -1
                yield "retry: 2000\n\n"
                while not c.closing.is_set():
                    version = await c.live.changes.wait(seen, HEARTBEAT_S)
                    html = await run_in_threadpool(c.overview_html)
                    yield (
                        "event: overview\n" + "".join(f"data: {line}\n" for line in html.splitlines()) + "\n"
                    )
                    seen = version
                    await asyncio.sleep(1 / PUSHES_PER_S)
            finally:
                c.streams -= 1

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    @app.get("/groups", response_model=None)
    def groups(request: Request) -> Response:
        params = dict(request.query_params)
        now = time.time()
        parsed = parse_filter(params, now)
        if isinstance(parsed, str):
            return c.page(
                "groups.html",
                status_code=400,
                error=parsed,
                rows=[],
                total=0,
                page=1,
                pages=1,
                params=params,
                times={},
            )
        page = max(1, _int(params.get("page"), 1) or 1)
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            head = fold.position
            if parsed.q is not None and not any(
                params.get(k) for k in ("status", "agent", "trainer", "step", "level", "since", "until")
            ):
                exact = group_summary(fold.ledger, parsed.q)
                if exact is not None:
                    return RedirectResponse(f"/groups/{_segment(parsed.q)}", status_code=303)
                owner = group_id_of(parsed.q)
                if owner and group_summary(fold.ledger, owner) is not None:
                    return RedirectResponse(f"/rollouts/{_segment(parsed.q)}", status_code=303)
        after = first_position_at(c.store, parsed.since, head) if parsed.since is not None else None
        before = first_position_at(c.store, parsed.until, head) if parsed.until is not None else None
        with c.live.state() as fold:
            assert fold is not None
            rows, total = list_groups(fold.ledger, parsed, page, after, before)
        times = c.times({r.position for r in rows})
        pages = max(1, math.ceil(total / PER_PAGE))
        return c.page(
            "groups.html",
            error=None,
            rows=rows,
            total=total,
            page=page,
            pages=pages,
            params=params,
            times=times,
        )

    @app.get("/groups/{group_id}", response_model=None)
    def group(group_id: str) -> Response:
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            summary = group_summary(fold.ledger, group_id)
            state = fold.ledger.groups.get(group_id)
            siblings: list[tuple[str, str, int, int | None, float | None]] | None = (
                [
                    (s.rollout_id, s.status, len(s.attempts), s.sealed_attempt, s.reward)
                    for _, s in sorted(state.siblings.items())
                ]
                if state is not None
                else None
            )
            claims = [] if summary is None else list(summary.claimed_steps)
        if summary is None:
            return c.not_found(f"group {group_id}")
        if siblings is None:  # archived: its siblings are read back from its stream
            siblings = _siblings_of(c, group_id)
        return c.page(
            "group.html", group=summary, siblings=siblings, claims=claims, times=c.times({summary.position})
        )

    @app.get("/rollouts/{rollout_id}", response_model=None)
    def rollout(rollout_id: str, zoom: str = "fit") -> Response:
        view = _rollout(c, rollout_id)
        if view is None:
            return c.not_found(f"rollout {rollout_id}")
        zoom = zoom if zoom in ZOOMS else "fit"
        return c.page(
            "rollout.html",
            view=view,
            zoom=zoom,
            zooms=list(ZOOMS),
            svg=render_svg(view.timeline, ZOOMS[zoom]),
        )

    @app.get("/rollouts/{rollout_id}/swimlane", response_model=None)
    def swimlane(rollout_id: str, zoom: str = "fit") -> Response:
        view = _rollout(c, rollout_id)
        if view is None:
            return c.not_found(f"rollout {rollout_id}")
        zoom = zoom if zoom in ZOOMS else "fit"
        return HTMLResponse(
            c.render(
                "_swimlane.html",
                view=view,
                zoom=zoom,
                zooms=list(ZOOMS),
                svg=render_svg(view.timeline, ZOOMS[zoom]),
            ),
            headers={"cache-control": "no-store"},
        )

    @app.get("/rollouts/{rollout_id}/tries/{attempt}/payloads", response_model=None)
    def payloads(rollout_id: str, attempt: str) -> Response:
        n = _int(attempt, -1)
        view = _rollout(c, rollout_id) if n is not None and n >= 0 else None
        found = None if view is None else next((a for a in view.attempts if a.index == n), None)
        if view is None or found is None:
            return c.not_found(f"try #{attempt} of rollout {rollout_id}")
        plane = payload_plane(c.store, c.config.payloads)
        decoded = payloads_view(rollout_id, found.index, found.claims, plane.get)
        return HTMLResponse(c.render("_payloads.html", p=decoded), headers={"cache-control": "no-store"})

    @app.get("/checkpoints", response_model=None)
    def checkpoints(page: str = "1", status: str = "") -> Response:
        number = max(1, _int(page, 1) or 1)
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            rows, total = list_checkpoints(fold.checkpoints, fold.generation, number, status or None)
            counts = dict(fold.checkpoint_counts)
        pages = max(1, math.ceil(total / CHECKPOINTS_PER_PAGE))
        times = c.times({r.started_position for r in rows if r.started_position})
        return c.page(
            "checkpoints.html",
            rows=rows,
            total=total,
            page=number,
            pages=pages,
            status=status,
            counts=counts,
            times=times,
        )

    @app.get("/checkpoints/{checkpoint_id}", response_model=None)
    def checkpoint(checkpoint_id: str) -> Response:
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            state = fold.checkpoints.checkpoints.get(checkpoint_id)
            if state is None:
                return c.not_found(f"checkpoint {checkpoint_id}")
            started = state.started_position
            decided = state.committed_position or state.aborted_position or fold.position
            head = fold.position
        own = list(c.store.read_stream(checkpoint_stream(checkpoint_id)))
        window = (
            events_between(c.store, started - 1, min(decided, head), WINDOW_TYPES, WINDOW_EVENTS)
            if started is not None
            else []
        )
        times = c.times({p for p in (started, state.committed_position, state.aborted_position) if p})
        with c.live.state() as fold:
            assert fold is not None
            detail = checkpoint_detail(
                state, fold.generation, times.get(started) if started else None, time.time(), own, window
            )
        return c.page("checkpoint.html", d=detail, times=times, state=state)

    @app.get("/steps", response_model=None)
    def steps(page: str = "1") -> Response:
        number = max(1, _int(page, 1) or 1)
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            found, total = train_steps(fold.steps, number)
        pages = max(1, math.ceil(total / PER_PAGE))
        return c.page("steps.html", steps=found, total=total, page=number, pages=pages)

    @app.get("/steps/{step}", response_model=None)
    def step(step: str) -> Response:
        wanted_step = None if step == "none" else _int(step, -1)
        if step != "none" and wanted_step is None:
            return c.not_found(f"train step {step}")
        with c.live.state() as fold:
            if fold is None:
                return c.page("loading.html", progress=c.live.progress())
            claimed = step_groups(fold.ledger, fold.steps, wanted_step)
        samples = [(row, position, _sealed_samples(c, row.group_id)) for row, position in claimed]
        return c.page(
            "step.html", step=wanted_step, samples=samples, times=c.times({p for _, p, _ in samples})
        )

    @app.get("/audit", response_class=HTMLResponse)
    def audit() -> HTMLResponse:
        return c.page("audit.html", **_checks(c))

    @app.get("/audit/status", response_class=HTMLResponse)
    def audit_status() -> HTMLResponse:
        return HTMLResponse(c.render("_checks.html", **_checks(c)), headers={"cache-control": "no-store"})

    @app.get("/audit/run", response_model=None)
    def audit_run(request: Request, check: str = "audit") -> Response:
        if check not in KINDS:
            return c.page(
                "audit.html", status_code=400, error=f"check takes one of {', '.join(KINDS)}", **_checks(c)
            )
        kind: Kind = "audit" if check == "audit" else "verify"
        c.jobs.start(kind, c.live.progress().position)
        if request.headers.get("hx-request"):
            return HTMLResponse(c.render("_checks.html", **_checks(c)), headers={"cache-control": "no-store"})
        return RedirectResponse("/audit", status_code=303)

    @app.get("/events/{position}", response_model=None)
    def event(position: str) -> Response:
        number = _int(position, 0)
        found = event_at(c.store, number) if number is not None and number > 0 else None
        if found is None:
            return c.not_found(f"event at position {position}")
        try:
            decoded = decode(found)
            summary, about, problem = describe(decoded), getattr(decoded, "rollout_id", None), None
        except ReplayRefused as exc:
            summary, about, problem = "", None, exc.reason
        return c.page(
            "event.html",
            e=found,
            summary=summary,
            about=about,
            problem=problem,
            data=_pretty(found.data_json),
            metadata=_pretty(found.metadata_json),
        )


def _pretty(text: str) -> str:
    import orjson

    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONDecodeError:
        return text


def _checks(c: Console) -> dict[str, Any]:
    return {
        "running": {k: c.jobs.running(k) for k in KINDS},
        "last": {k: c.jobs.last(k) for k in KINDS},
        "error": None,
    }


def _rollout(c: Console, rollout_id: str) -> Any:
    group_id = group_id_of(rollout_id) or rollout_id
    with c.live.state() as fold:
        summary = group_summary(fold.ledger, group_id) if fold is not None else None
    agents = [summary.agent] if summary is not None else []
    view = rollout_view(rollout_id, rollout_events(c.store, group_id, agents))
    if view is not None and summary is not None:
        view.group_status = summary.status + (" (archived)" if summary.archived else "")
        view.trainer = summary.trainer
    return view


def _siblings_of(c: Console, group_id: str) -> list[tuple[str, str, int, int | None, float | None]]:
    from projections.ledger import LedgerProjection, LedgerState

    ledger = LedgerState()
    projection = LedgerProjection()
    for event in c.store.read_stream(group_stream(group_id)):
        try:
            projection.apply(ledger, event, decode(event))
        except ReplayRefused:
            continue
    state = ledger.groups.get(group_id)
    if state is None:
        return []
    return [
        (s.rollout_id, s.status, len(s.attempts), s.sealed_attempt, s.reward)
        for _, s in sorted(state.siblings.items())
    ]


def _sealed_samples(c: Console, group_id: str) -> list[dict[str, Any]]:
    """The sealed siblings of a group, each with the digests of what was trained on: its token
    records and its reply (read from the group's stream)."""
    from eventstore.events import RunReplied, SiblingSealed

    replies: dict[tuple[str, int], str] = {}
    out = []
    for event in c.store.read_stream(group_stream(group_id)):
        if event.type not in (RunReplied.event_type(), SiblingSealed.event_type()):
            continue
        try:
            decoded = decode(event)
        except ReplayRefused:
            continue
        if isinstance(decoded, RunReplied):
            replies[(decoded.rollout_id, decoded.attempt_index)] = decoded.reply_digest
        elif isinstance(decoded, SiblingSealed):
            r = decoded.receipt
            out.append(
                {
                    "rollout_id": decoded.rollout_id,
                    "attempt": decoded.attempt_index,
                    "reward": decoded.reward,
                    "tokens": r.token_count,
                    "tokens_digest": r.tokens_digest,
                    "reply_digest": replies.get((decoded.rollout_id, decoded.attempt_index)),
                    "position": event.position,
                    "masked": r.mask_sample,
                }
            )
    return out


__all__ = ["ZOOMS", "Console", "ConsoleConfig", "create_app"]
