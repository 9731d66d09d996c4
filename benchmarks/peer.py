"""The peer: NeMo Gym 0.7.0's own rollout collector beside `ledger simulate --agent-url`, on the same real
agents.

The real Gym's servers run in their own environment (nemo-gym 0.7.0 on Python 3.13.0,
`benchmarks.realgym`): one stub model (`stub_model.py`), `example_single_tool_call`, and `simple_agent`
twice, plain and with the participant mounted (`serve_agent.py`).  Three sides collect the same
rollouts (one prompt group of `--siblings` tries a row, two model calls a rollout, no faults, no
checkpoints), each as a process of its own:

- `collector`: `gym eval run --no-serve` (0.7.0's `ng_collect_rollouts`: `RolloutCollectionHelper`,
  which POSTs `/run`, parses the reply with orjson and appends a line to a file), `num_repeats` the
  siblings and `num_samples_in_parallel` the ledger's window, against the plain agent
  (`collector_config.py` says how its `/run` reaches the agent);
- `plain`: `ledger simulate --agent-url` against the plain agent (reduced mode);
- `mounted`: `ledger simulate --agent-url --agent-state-dir` against the agent with the participant
  mounted.

Both ledger sides keep their log where `--db` says (by default a fresh SQLite file a run, with the
payload directory beside it: the embedded default; a PostgreSQL URL keeps log and payloads in that
database, and `--pg-data` names the cluster's data directory when it runs on this machine, so that
its CPU is measured beside the ledger's: the postmaster, its live and its reaped backends).  Both sides keep 3 x siblings rollouts in flight
(`SimConfig.window_per_agent` groups' worth): the collector's `num_samples_in_parallel`, the ledger's
`--in-flight` (a group admitted as soon as fewer are in flight).  Sides run one
after another, their order reversed every round; each figure is the median over the rounds, with
the lowest and highest beside it.

Rollouts are counted from each side's output: the collector's JSONL lines, the ledger's sealed
rollouts in its log (`SiblingSealed`).  While a side runs, the counts and each process's CPU (user +
system, from /proc: the side's own process, the agent it drives, the model stub, the resources
server) are sampled every 0.1 s.  Figures are taken **after start-up**: from the first sample at
which a first window of rollouts (the rollouts in flight) is done to the first at which all are, so
interpreter start, imports, the log's migration and what a side does after its last rollout (the
ledger's audit and summary) are outside.  Per rollout: the trainer's CPU (the collector's or the
ledger's process), rollouts/s, the agent's CPU; and the model stub's calls a rollout (2.00 when
every rollout ran whole).

Sizes: `tiny` (the stub's few tokens an item), `9k` (a first prompt of 1,000 tokens and 8,000
generated over the rollout's two calls), `64k` (32,000 + 32,000).  `--routes`: the MoE router's
choices the model answers with each call, as nested lists (a `[[e1, e2]]` per token, the default) or
as NeMo RL's generation worker ships them for router replay (one `nrlre1` envelope string).

    python -m benchmarks.peer                                # tiny and 9k, two rounds
    python -m benchmarks.peer --sizes tiny 9k 64k --rounds 4 --json peer.json
    python -m benchmarks.peer --sizes tiny 9k --rollouts tiny=480 9k=96       # a quicker run
    python -m benchmarks.peer --sizes 9k --routes envelope
    python -m benchmarks.peer --db postgresql+psycopg://USER@HOST:PORT/DB --pg-data /path/to/cluster/data

Ctrl-C or SIGTERM stops the servers and the side running, and says so in one line (exit status 130 /
143); a run that does not end within `--run-timeout` is killed and reported incomplete (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.realgym.servers import RealGym, real_gym
from benchmarks.rollout_sizes import positive
from benchmarks.soak import cpu_s, postgres_cpu_s
from eventstore import open_store
from simulation.config import SimConfig

# (first prompt, generated over the rollout) in tokens; (0, 0): the stub's own few tokens an item.
SIZES: Final[dict[str, tuple[int, int]]] = {"tiny": (0, 0), "9k": (1000, 8000), "64k": (32000, 32000)}
ROLLOUTS: Final[dict[str, int]] = {"tiny": 960, "9k": 192, "64k": 48}
SIDES: Final = ("collector", "plain", "mounted")
LABELS: Final = {
    "collector": "Gym 0.7.0 collector",
    "plain": "ledger, plain agent",
    "mounted": "ledger, mounted agent",
}
# The real Gym's server each side drives, and that agent's name in the Gym's config.
AGENT_OF: Final = {"collector": "plain_agent", "plain": "plain_agent", "mounted": "agent"}
GYM_NAME: Final = {"plain_agent": "simple_agent_plain", "agent": "simple_agent"}
PROCESSES: Final = ("trainer", "agent", "model", "resources", "postgres")
WINDOW_PER_AGENT: Final[int] = SimConfig.window_per_agent  # the dataclass's default: 3 groups an agent
POLL_S: Final = 0.1
SEALED: Final = "SiblingSealed"


@dataclass(frozen=True)
class Sample:
    at: float
    rollouts: int
    cpu_s: dict[str, float]


@dataclass
class Run:
    """One side's run: what its output holds, and its figures after start-up (None when the run was
    too short for a window)."""

    side: str
    size: str
    round: int
    expected: int
    rollouts: int = 0
    model_calls: int = 0
    exit_code: int | None = None
    wall_s: float = 0.0
    window_rollouts: int = 0
    window_s: float = 0.0
    window_cpu_s: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.exit_code == 0 and self.rollouts == self.expected

    def cpu_ms(self, process: str) -> float | None:
        if not self.window_rollouts or process not in self.window_cpu_s:
            return None
        return 1000 * self.window_cpu_s[process] / self.window_rollouts

    def rate(self) -> float | None:
        return self.window_rollouts / self.window_s if self.window_s > 0 else None

    def figures(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "size": self.size,
            "round": self.round,
            "expected": self.expected,
            "rollouts": self.rollouts,
            "complete": self.complete,
            "model_calls_per_rollout": round(self.model_calls / self.rollouts, 3) if self.rollouts else None,
            "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 2),
            "window_rollouts": self.window_rollouts,
            "window_s": round(self.window_s, 3),
            "rollouts_per_s": _round(self.rate(), 2),
            **{f"{p}_cpu_ms_per_rollout": _round(self.cpu_ms(p), 3) for p in PROCESSES},
            "error": self.error,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def window(
    samples: Sequence[Sample], start_at: int, total: int
) -> tuple[int, float, dict[str, float]] | None:
    """(rollouts, seconds, CPU seconds by process) from the first sample with `start_at` rollouts done
    to the first with `total`; None when there is no such pair (a run too short, or incomplete)."""
    first = next((s for s in samples if s.rollouts >= start_at), None)
    last = next((s for s in samples if s.rollouts >= total), None)
    if first is None or last is None or last.rollouts <= first.rollouts or last.at <= first.at:
        return None
    cpu = {p: last.cpu_s[p] - first.cpu_s[p] for p in last.cpu_s if p in first.cpu_s}
    return last.rollouts - first.rollouts, last.at - first.at, cpu


class LineCounter:
    """Lines in a JSONL file that grows (the collector flushes a line a rollout), read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def __call__(self) -> int:
        with suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset += len(chunk)
            self.lines += chunk.count(b"\n")
        return self.lines


class SealCounter:
    """Sealed rollouts appended to a log after `after` (its head when the run started)."""

    def __init__(self, url: str) -> None:
        self.store = open_store(url, migrate_schema=True)
        self.after = self.store.head()
        self.sealed = 0

    def __call__(self) -> int:
        for event in self.store.read_all(self.after, types=[SEALED]):
            self.after = event.position
            self.sealed += 1
        return self.sealed

    def close(self) -> None:
        self.store.close()


def _model_calls(gym: RealGym) -> int:
    reply = httpx.get(gym.servers["model"].url + "/stats", timeout=30)
    reply.raise_for_status()
    return int(reply.json()["calls"])


def _watch(
    process: subprocess.Popen[bytes],
    count: Callable[[], int],
    pids: dict[str, int],
    deadline: float,
    pg_data: Path | None = None,
) -> list[Sample]:
    """Samples of the rollouts done and each process's CPU until `process` exits (killed past
    `deadline`: TimeoutError); with `pg_data`, also the PostgreSQL cluster's there (`postgres`)."""
    samples: list[Sample] = []
    while True:
        cpu = {name: used for name, pid in pids.items() if (used := cpu_s(pid)) is not None}
        if pg_data is not None and (used := postgres_cpu_s(pg_data)) is not None:
            cpu["postgres"] = used
        samples.append(Sample(time.monotonic(), count(), cpu))
        if process.poll() is not None:
            return samples
        if time.monotonic() > deadline:
            process.kill()
            process.wait(30)
            raise TimeoutError(f"still running after its budget ({len(samples)} samples)")
        time.sleep(POLL_S)


@dataclass(frozen=True)
class Plan:
    sizes: Sequence[str]
    rounds: int
    rollouts: dict[str, int]
    siblings: int
    db: str | None
    run_timeout_s: float
    routes: str = "lists"
    pg_data: Path | None = None

    @property
    def in_flight(self) -> int:
        return WINDOW_PER_AGENT * self.siblings

    def groups(self, size: str) -> int:
        return max(1, -(-self.rollouts[size] // self.siblings))


class Sides:
    """Runs each side against one set of servers (one size)."""

    def __init__(self, gym: RealGym, plan: Plan, size: str, workdir: Path) -> None:
        self.gym, self.plan, self.size, self.workdir = gym, plan, size, workdir
        self.groups = plan.groups(size)
        self.expected = self.groups * plan.siblings
        rows = workdir / "rows.jsonl"
        # The ledger's workload (`simulation.run.workload_payload`): the same prompts on every side.
        with open(rows, "w") as f:
            for i in range(self.groups):
                f.write(
                    json.dumps(
                        {"responses_create_params": {"input": [{"role": "user", "content": f"{i}+{i}?"}]}}
                    )
                )
                f.write("\n")
        self.rows = rows
        self.runs = 0

    def run(self, side: str, round_: int) -> Run:
        self.runs += 1
        here = self.workdir / f"{self.runs:02d}-{side}"
        here.mkdir()
        agent = self.gym.servers[AGENT_OF[side]]
        result = Run(side=side, size=self.size, round=round_, expected=self.expected)
        pids = {
            "agent": agent.process.pid,
            "model": self.gym.servers["model"].process.pid,
            "resources": self.gym.servers["resources"].process.pid,
        }
        calls_before = _model_calls(self.gym)
        started = time.monotonic()
        count: Callable[[], int]
        seals: SealCounter | None = None
        if side == "collector":
            output = here / "rollouts.jsonl"
            made = self.gym.run_script(
                "collector_config.py", str(self.gym.workdir / "gym.yaml"), GYM_NAME[AGENT_OF[side]],
                str(self.rows), str(output), str(self.plan.siblings), str(self.plan.in_flight),
                str(here / "collector.yaml"),
            )  # fmt: skip
            if made.returncode != 0:
                raise RuntimeError(f"collector_config.py failed:\n{made.stderr[-3000:]}")
            argv = [str(self.gym.env / "bin" / "gym"), "eval", "run", "--no-serve"]
            env = self.gym.env_vars(NEMO_GYM_CONFIG_DICT=(here / "collector.yaml").read_text())
            count = LineCounter(output)
        else:
            url = self.plan.db or f"sqlite:///{here / 'ledger.db'}"
            seals = SealCounter(url)
            count = seals
            name = GYM_NAME[AGENT_OF[side]]
            argv = [sys.executable, "-m", "cli.main", "simulate", "--db", url, "--agent-url", f"{name}={agent.url}",
                    "--groups", str(self.groups), "--siblings", str(self.plan.siblings), "--faults", "",
                    "--in-flight", str(self.plan.in_flight),
                    "--checkpoint-every", "0", "--rollout-timeout", "300", "--json"]  # fmt: skip
            if side == "mounted":
                argv += ["--agent-state-dir", f"{name}={self.gym.state_dir}"]
            env = dict(os.environ)
        try:
            with open(here / "stdout.log", "wb") as out, open(here / "stderr.log", "wb") as err:
                process = subprocess.Popen(argv, cwd=here, env=env, stdout=out, stderr=err)
            try:
                samples = _watch(
                    process,
                    count,
                    {"trainer": process.pid, **pids},
                    started + self.plan.run_timeout_s,
                    self.plan.pg_data if side != "collector" else None,
                )
            except TimeoutError as exc:
                result.error = str(exc)
                samples = []
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
            result.exit_code = process.returncode
            result.wall_s = time.monotonic() - started
            result.rollouts = count()
        finally:
            if seals is not None:
                seals.close()
        result.model_calls = _model_calls(self.gym) - calls_before
        if result.exit_code != 0 and result.error is None:
            result.error = f"exit status {result.exit_code}: {(here / 'stderr.log').read_text()[-500:]}"
        measured = window(samples, self.plan.in_flight, result.rollouts) if result.complete else None
        if measured is not None:
            result.window_rollouts, result.window_s, result.window_cpu_s = measured
        return result


def order(round_: int) -> tuple[str, ...]:
    """The sides in the order of round `round_`: reversed every other round."""
    return SIDES if round_ % 2 == 0 else tuple(reversed(SIDES))


@contextmanager
def _workdir(keep: str | None) -> Iterator[Path]:
    if keep is not None:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="peer-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(plan: Plan, keep: str | None = None, progress: Callable[[Run], None] | None = None) -> dict[str, Any]:
    """Every size, every round, every side; the runs' figures and the medians (`summary`)."""
    runs: list[Run] = []
    with _workdir(keep) as root:
        for size in plan.sizes:
            prompt, generated = SIZES[size]
            model_args = ["--prompt-tokens", str(prompt), "--gen-tokens", str(generated)] if generated else []
            model_args += ["--routes", plan.routes]
            workdir = root / size
            workdir.mkdir()
            (workdir / "gym").mkdir()
            with real_gym(workdir / "gym", model_args=model_args, environment_server=False) as gym:
                sides = Sides(gym, plan, size, workdir)
                for round_ in range(plan.rounds):
                    for side in order(round_):
                        done = sides.run(side, round_)
                        runs.append(done)
                        if progress is not None:
                            progress(done)
    return {
        "plan": {
            "sizes": list(plan.sizes),
            "rounds": plan.rounds,
            "rollouts": {s: plan.groups(s) * plan.siblings for s in plan.sizes},
            "siblings": plan.siblings,
            "in_flight": plan.in_flight,
            "db": plan.db or "sqlite (a fresh file a run)",
            "routes": plan.routes,
        },
        "runs": [r.figures() for r in runs],
        "summary": summarize(runs, plan.sizes),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def summarize(runs: Sequence[Run], sizes: Sequence[str]) -> dict[str, Any]:
    """Per size and side: median, lowest and highest of each figure over the complete runs; and the
    ratios of the medians (the worse ledger side against the collector; mounted against plain)."""
    out: dict[str, Any] = {}
    for size in sizes:
        per_side: dict[str, Any] = {}
        for side in SIDES:
            done = [r for r in runs if r.size == size and r.side == side]
            ok = [r for r in done if r.complete and r.window_rollouts]
            figures: dict[str, Any] = {
                "runs": len(done),
                "complete": sum(r.complete for r in done),
                "measured": len(ok),
                "rollouts_per_s": _spread([v for r in ok if (v := r.rate()) is not None]),
                "model_calls_per_rollout": _spread([r.model_calls / r.rollouts for r in done if r.rollouts]),
            }
            for p in PROCESSES:
                figures[f"{p}_cpu_ms"] = _spread([v for r in ok if (v := r.cpu_ms(p)) is not None])
            per_side[side] = figures
        out[size] = {"sides": per_side, "ratios": _ratios(per_side)}
    return out


def _median(per_side: dict[str, Any], side: str, figure: str) -> float | None:
    spread = per_side[side][figure]
    return None if spread is None else float(spread["median"])


def _ratios(per_side: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else round(a / b, 2)

    trainer = [_median(per_side, s, "trainer_cpu_ms") for s in ("plain", "mounted")]
    rates = [_median(per_side, s, "rollouts_per_s") for s in ("plain", "mounted")]
    return {
        "trainer_cpu_ledger_over_collector": ratio(
            max((t for t in trainer if t is not None), default=None),
            _median(per_side, "collector", "trainer_cpu_ms"),
        ),
        "rollouts_per_s_ledger_over_collector": ratio(
            min((r for r in rates if r is not None), default=None),
            _median(per_side, "collector", "rollouts_per_s"),
        ),
        "agent_cpu_mounted_over_plain": ratio(
            _median(per_side, "mounted", "agent_cpu_ms"), _median(per_side, "plain", "agent_cpu_ms")
        ),
    }


# The table's rows: (label, figure, format, ratio key).
ROWS: Final = (
    ("trainer CPU", "trainer_cpu_ms", "{:.2f} ms", "trainer_cpu_ledger_over_collector"),
    ("rollouts/s", "rollouts_per_s", "{:.1f}", "rollouts_per_s_ledger_over_collector"),
    ("agent CPU", "agent_cpu_ms", "{:.2f} ms", "agent_cpu_mounted_over_plain"),
)
RATIO_NAMES: Final = {
    "trainer_cpu_ledger_over_collector": "",
    "rollouts_per_s_ledger_over_collector": "",
    "agent_cpu_mounted_over_plain": "mounted/plain ",
}


def _cell(spread: dict[str, float] | None, fmt: str) -> str:
    if spread is None:
        return "-"
    median, low, high = (fmt.format(spread[k]) for k in ("median", "low", "high"))
    return median if low == high else f"{median} ({low.split()[0]}-{high})"


def print_result(result: dict[str, Any], console: Console) -> None:
    plan = result["plan"]
    table = Table(
        title=f"per rollout, after start-up: median (lowest-highest) of {plan['rounds']} rounds, "
        f"{plan['in_flight']} in flight, {os.cpu_count()} cores"
    )
    table.add_column("per rollout, after start-up")
    for side in SIDES:
        table.add_column(LABELS[side], justify="right")
    table.add_column("ratio (worse side)", justify="right")
    for label, figure, fmt, ratio_key in ROWS:
        for size, summary in result["summary"].items():
            ratio = summary["ratios"][ratio_key]
            table.add_row(
                f"{label}, {size}",
                *[_cell(summary["sides"][side][figure], fmt) for side in SIDES],
                "-" if ratio is None else f"{RATIO_NAMES[ratio_key]}{ratio:.2f}x",
            )
    console.print(table)
    other = Table(title="the other processes, and the runs")
    other.add_column("size, side")
    for name in (
        "model stub CPU",
        "resources CPU",
        "PostgreSQL CPU",
        "model calls a rollout",
        "runs complete / measured",
    ):
        other.add_column(name, justify="right")
    for size, summary in result["summary"].items():
        for side in SIDES:
            s = summary["sides"][side]
            other.add_row(
                f"{size}, {LABELS[side]}",
                _cell(s["model_cpu_ms"], "{:.2f} ms"),
                _cell(s["resources_cpu_ms"], "{:.2f} ms"),
                _cell(s["postgres_cpu_ms"], "{:.2f} ms"),
                _cell(s["model_calls_per_rollout"], "{:.2f}"),
                f"{s['complete']} / {s['measured']} of {s['runs']}",
            )
    console.print(other)


def rollouts_option(text: str) -> dict[str, int]:
    """An argparse type: `N` (every size) or `SIZE=N`, else its one-line error."""
    size, sep, count = text.rpartition("=")
    if sep and size not in SIZES:
        raise argparse.ArgumentTypeError(f"{size!r} is no size ({', '.join(SIZES)})")
    n = positive(count)
    return {size: n} if sep else dict.fromkeys(SIZES, n)


class Stopped(Exception):
    """SIGTERM: the run winds down as after Ctrl-C (servers and the side running stopped)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["tiny", "9k"])
    parser.add_argument("--rounds", type=positive, default=2, help="Runs of each side a size (default 2).")
    parser.add_argument(
        "--rollouts",
        type=rollouts_option,
        nargs="+",
        default=[],
        metavar="N|SIZE=N",
        help="Rollouts a run: N for every size, SIZE=N for one "
        f"(default: {' '.join(f'{k}={v}' for k, v in ROLLOUTS.items())}).",
    )
    parser.add_argument("--siblings", type=positive, default=4, help="Tries a prompt group (default 4).")
    parser.add_argument(
        "--db", default=None, help="The ledger's log (a URL); default: a fresh SQLite file a run."
    )
    parser.add_argument(
        "--routes",
        choices=("lists", "envelope"),
        default="lists",
        help="The model's routed_experts: nested lists (default), or NeMo RL's nrlre1 envelope string.",
    )
    parser.add_argument(
        "--pg-data",
        type=Path,
        default=None,
        help="With --db on a PostgreSQL cluster of this machine: its data directory, whose CPU is measured too.",
    )
    parser.add_argument(
        "--run-timeout", type=positive, default=900, help="Seconds one side's run may take (default 900)."
    )
    parser.add_argument("--keep", default=None, help="Keep every run's files in this directory.")
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)
    plan = Plan(
        sizes=args.sizes,
        rounds=args.rounds,
        rollouts={**ROLLOUTS, **{k: v for given in args.rollouts for k, v in given.items()}},
        siblings=args.siblings,
        db=args.db,
        run_timeout_s=float(args.run_timeout),
        routes=args.routes,
        pg_data=args.pg_data,
    )
    # A table as wide as its columns where stdout is no terminal (a file, a pipe).
    console = Console(width=None if sys.stdout.isatty() else 160)

    def said(done: Run) -> None:
        rate = done.rate()
        console.print(
            f"{done.size} round {done.round + 1} {LABELS[done.side]}: {done.rollouts}/{done.expected} rollouts"
            + (f", {rate:.1f}/s" if rate else "")
            + (f" [red]{done.error}[/red]" if done.error else ""),
            highlight=False,
        )

    def stopped(signum: int, _: object) -> None:
        raise Stopped(128 + signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        result = run(plan, keep=args.keep, progress=said)
    except (KeyboardInterrupt, Stopped) as exc:
        console.print("interrupted: the servers and the side running were stopped")
        return exc.code if isinstance(exc, Stopped) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_result(result, console)
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    incomplete = [r for r in result["runs"] if not r["complete"]]
    if incomplete:
        console.print(f"[red]{len(incomplete)} run(s) incomplete[/red]: " + "; ".join(
            f"{r['size']} {r['side']} round {r['round'] + 1}: {r['rollouts']}/{r['expected']} ({r['error']})"
            for r in incomplete
        ))  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
