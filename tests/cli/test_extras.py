"""The `ledger` command with only the trainer extra installed: every command that needs no torch works,
one that needs another extra says which in one line, and `ledger --help` imports none of the heavy parts.

The commands run in a child interpreter where torch and Triton cannot be imported (as after
`pip install '.[trainer]'`): `sys.modules[name] = None` makes every import of them fail as a missing
package does.  One child runs all the commands in turn (a process each would cost seconds per
command), marking where each one's output starts, and reports at the end what it had imported.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from eventstore import open_store, upgrade_database
from tests.projections.builder import LogBuilder

REPO = Path(__file__).parents[2]
# What the workers and agent extras bring; the trainer extra has none of it.
NOT_INSTALLED = ("torch", "triton")
# (Not pydantic: typer itself imports it to show a command's options.)
HEAVY = ("torch", "triton", "numpy", "sqlalchemy", "psycopg", "httpx", "uvicorn", "trainer", "workers")

CHILD = textwrap.dedent(
    """
    import json, sys
    blocked, commands = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for name in blocked:
        sys.modules[name] = None  # not installed
    from cli.main import app
    codes = []
    for argv in commands:
        for stream in (sys.stdout, sys.stderr):
            print("=== " + " ".join(argv), file=stream, flush=True)
        try:
            app(argv, prog_name="ledger")
            codes.append(0)
        except SystemExit as exc:
            codes.append(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
        except BaseException as exc:  # an import of what is not installed, say
            import traceback
            traceback.print_exc()
            codes.append(f"raised {type(exc).__name__}")
        sys.stdout.flush(); sys.stderr.flush()
    imported = sorted(m for m in sys.modules if sys.modules[m] is not None)
    print("=== RESULT " + json.dumps({"codes": codes, "imported": imported}), flush=True)
    """
)


def run_commands(commands: list[list[str]], blocked: tuple[str, ...], tmp_path: Path) -> dict[str, Any]:
    env = dict(os.environ, COLUMNS="200", XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("LEDGER_DB", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(list(blocked)), json.dumps(commands)],
        capture_output=True, text=True, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out, result = done.stdout.rsplit("=== RESULT ", 1)
    found: dict[str, Any] = json.loads(result)

    def sections(text: str) -> list[str]:
        return text.split("=== ")[1:]

    found["out"], found["err"] = sections(out), sections(done.stderr)
    assert len(found["codes"]) == len(found["out"]) == len(found["err"]) == len(commands), done.stderr
    return found


def _top(modules: list[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_help_imports_nothing_heavy(tmp_path: Path) -> None:
    """`ledger --help` and each group's help: typer and rich only (before: torch, Triton and the whole
    trainer, 2.3 s and 370 MB)."""
    commands = [
        ["--help"],
        ["simulate", "--help"],
        ["worker", "logprobs", "--help"],
        ["gym", "serve", "--help"],
    ]
    found = run_commands(commands, (*NOT_INSTALLED, "numpy"), tmp_path)
    assert found["codes"] == [0, 0, 0, 0], found["err"]
    assert "simulate" in found["out"][0] and "--resume" in found["out"][1]
    assert not _top(found["imported"]) & set(HEAVY), sorted(_top(found["imported"]) & set(HEAVY))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_command_that_needs_no_torch_works_with_the_trainer_extra_alone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    log = LogBuilder(store)
    log.clean_sibling_group("p1", 1)
    log.reserve("p2", 1)
    log.mint("p2", 1)
    log.dispatch("p2_g0")
    log.reply("p2_g0")
    log.seal("p2_g0")  # its ACK debt is owed
    store.close()
    nobody = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    db = ["--db", url]
    commands = [
        ["db", "upgrade", "--db", fresh],
        ["db", "current", *db],
        ["status", *db],
        ["audit", *db],
        ["replay", "--verify", *db],
        ["snapshot", *db],
        ["show", "p2_g0", *db],
        ["tail", "--from", "0", "--idle-exit", "0", *db],
        ["debt", "list", *db],
        ["projections", "run", "--once", *db],
        # Needs no torch either: it drives agents that run elsewhere.  None answers: one line.
        ["simulate", "--agent-url", f"a={nobody}", "--groups", "1", *db],
        # These need another extra, and say so in one line.
        ["worker", "logprobs", "--once", *db],
        ["gym", "serve", "--name", "a", "--port", str(_free_port())],
        ["simulate", "--groups", "1", *db],
    ]
    found = run_commands(commands, NOT_INSTALLED, tmp_path)
    codes, out, err = found["codes"], found["out"], found["err"]
    for i, argv in enumerate(commands[:10]):
        assert codes[i] == 0, (argv, codes[i], out[i][-2000:], err[i][-2000:])
    assert "p2_g0" in out[8]  # the debt list, the id whole
    assert "agree" in out[4]
    for i in range(10, 14):
        lines = [line for line in err[i].splitlines()[1:] if line.strip()]
        assert codes[i] == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
            commands[i],
            codes[i],
            err[i],
        )
    assert "does not answer (" in err[10] and nobody in err[10]
    assert "needs the `workers` extra" in err[11] and "'.[workers]'" in err[11]
    assert "needs the `agent` extra" in err[12] and "needs the `agent` extra" in err[13]
    assert not _top(found["imported"]) & set(NOT_INSTALLED)
