"""The checks a person starts from the audit page, each in a process of its own.

`audit`: `projections.audit.audit_log` over the whole log and its payloads (what `ledger audit`
runs); `verify`: what `ledger replay --verify` compares (a rebuild from scratch, one from the nearest
projection checkpoint below the head, and the runner's checkpoint at the head when there is one) and
the hash chain (`EventStore.chain_breaks`).  A child process opens the log read-only with the
console's own URL (the auditor role), so a check of a long log neither holds the console's memory
nor its interpreter, and the pages stay quick while it runs.

One check of each kind at a time; each runs for at most `budget_s` and is then ended and recorded
as given up.  The last result of each kind is kept in memory (the overview shows the audit's).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from multiprocessing.connection import Connection
from typing import Any, Final, Literal

Kind = Literal["audit", "verify"]
KINDS: Final[tuple[Kind, ...]] = ("audit", "verify")
# Chain breaks listed at most (the first one is what matters; the audit lists them all).
CHAIN_BREAKS_SHOWN: Final = 20


@dataclass(frozen=True, slots=True)
class Running:
    kind: Kind
    started_at: float
    head: int | None


@dataclass(frozen=True, slots=True)
class Result:
    kind: Kind
    started_at: float
    finished_at: float
    ok: bool
    summary: str
    report: dict[str, Any]
    error: str | None = None


# --- in the child ----------------------------------------------------------------------


def _audit(url: str, payloads: str | None) -> dict[str, Any]:
    from eventstore import open_store
    from eventstore.payload_stores import payload_plane
    from projections.audit import audit_log

    store = open_store(url, read_only=True)
    try:
        report = audit_log(store, None, payload_plane(store, payloads))
        out = report.as_json()
        out["head"] = report.head
        return out
    finally:
        store.close()


def _verify(url: str, payloads: str | None) -> dict[str, Any]:
    from eventstore import open_store
    from projections.runner import (
        Replay,
        default_projections,
        latest_common_checkpoint,
        load_replay,
        read_batches,
        rebuild,
    )

    store = open_store(url, read_only=True)
    try:
        projections = default_projections()
        target = store.head()
        rows: list[tuple[str, Replay]] = [
            ("from scratch", rebuild(store, projections, to_position=target, from_checkpoint=False))
        ]
        below = latest_common_checkpoint(store, projections, target - 1) if target > 0 else None
        if below is not None:
            from_below = load_replay(store, projections, below)
            from_below.apply_batches(read_batches(store, below, target))
            rows.append((f"from checkpoint at {below}", from_below))
        if latest_common_checkpoint(store, projections, target) == target:
            rows.append((f"live (stored at {target})", load_replay(store, projections, target)))
        reference = rows[0][1].hashes()
        rebuilds = [{"rebuild": label, "position": r.position, "hashes": r.hashes()} for label, r in rows]
        agree = all(r["hashes"] == reference for r in rebuilds)
        breaks = [
            {"position": b.position, "reason": b.reason}
            for b in islice(store.chain_breaks(target), CHAIN_BREAKS_SHOWN)
        ]
        return {"head": target, "rebuilds": rebuilds, "agree": agree, "chain_breaks": breaks}
    finally:
        store.close()


_CHECKS: Final[dict[str, Callable[[str, str | None], dict[str, Any]]]] = {"audit": _audit, "verify": _verify}


def _child(kind: str, url: str, payloads: str | None, conn: Connection) -> None:
    try:
        conn.send({"ok": _CHECKS[kind](url, payloads)})
    except Exception as exc:  # the parent records it as the check's result, in one line
        conn.send({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
    finally:
        conn.close()


# --- in the console --------------------------------------------------------------------


def summarize(kind: Kind, report: dict[str, Any]) -> tuple[bool, str]:
    if kind == "audit":
        violations = report.get("violations") or []
        ok = not violations
        verdict = "clean" if ok else f"{len(violations)} violation(s)"
        return (
            ok,
            f"{report.get('events', 0):,} events, {len(report.get('rules_checked') or [])} rules: {verdict}",
        )
    breaks = report.get("chain_breaks") or []
    agree = bool(report.get("agree"))
    rebuilds = len(report.get("rebuilds") or [])
    chain = "hash chain verifies" if not breaks else f"hash chain breaks at {breaks[0]['position']}"
    same = f"{rebuilds} rebuilds agree" if agree else "state hashes differ"
    return agree and not breaks, f"{same} at position {report.get('head', 0)}; {chain}"


class Jobs:
    def __init__(
        self, url: str, payloads: str | None, on_change: Callable[[], None], budget_s: float = 1800.0
    ) -> None:
        self.url = url
        self.payloads = payloads
        self.on_change = on_change
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self._running: dict[Kind, Running] = {}
        self._processes: dict[Kind, multiprocessing.process.BaseProcess] = {}
        self._last: dict[Kind, Result] = {}
        self._closed = False

    def running(self, kind: Kind) -> Running | None:
        with self._lock:
            return self._running.get(kind)

    def last(self, kind: Kind) -> Result | None:
        with self._lock:
            return self._last.get(kind)

    def start(self, kind: Kind, head: int | None = None) -> bool:
        """Starts a check of `kind` unless one runs (False then)."""
        context = multiprocessing.get_context("spawn")  # the console has threads: no fork
        with self._lock:
            if self._closed or kind in self._running:
                return False
            parent, child = context.Pipe(duplex=False)
            process = context.Process(
                target=_child,
                args=(kind, self.url, self.payloads, child),
                name=f"console-{kind}",
                daemon=True,
            )
            process.start()
            child.close()
            self._running[kind] = Running(kind, time.time(), head)
            self._processes[kind] = process
        threading.Thread(target=self._watch, args=(kind, process, parent), daemon=True).start()
        self.on_change()
        return True

    def _watch(self, kind: Kind, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        started = self._running[kind].started_at
        message: dict[str, Any] | None = None
        error: str | None = None
        try:
            if conn.poll(self.budget_s):
                message = conn.recv()
            else:
                error = f"gave up after {self.budget_s:.0f} s (the check's budget)"
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
        process.join(5)
        if process.is_alive():
            process.terminate()
            process.join(5)
        if message is None and error is None:
            error = f"the check's process ended without a result (exit status {process.exitcode})"
        if message is not None and "error" in message:
            error = str(message["error"])
        report: dict[str, Any] = message.get("ok", {}) if message is not None else {}
        ok, summary = summarize(kind, report) if error is None else (False, f"did not finish: {error}")
        with self._lock:
            self._running.pop(kind, None)
            self._processes.pop(kind, None)
            self._last[kind] = Result(kind, started, time.time(), ok, summary, report, error)
        self.on_change()

    def close(self) -> None:
        """Ends the checks still running (their processes are this console's)."""
        with self._lock:
            self._closed = True
            processes = list(self._processes.values())
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)


__all__ = ["CHAIN_BREAKS_SHOWN", "KINDS", "Jobs", "Kind", "Result", "Running", "summarize"]
