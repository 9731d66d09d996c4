"""Ctrl-C while `ledger simulate` is still starting (importing the trainer, opening the log, starting
its agents), before the run's own signal handling takes over: one line and exit status 130, where typer
alone exits 130 saying nothing.  The interrupt is raised where the start-up opens the log."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

import cli.simulate
from cli.main import app


def _interrupted(*_: Any, **__: Any) -> Any:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "interrupted before the run started: nothing was submitted"),
        (
            ["--resume", "s0a1b2c"],
            "interrupted before the run started: carry on with: ledger simulate --resume s0a1b2c",
        ),
    ],
)
def test_an_interrupt_before_the_run_started_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, args: list[str], line: str
) -> None:
    monkeypatch.setattr(cli.simulate, "_run", _interrupted)
    result = CliRunner().invoke(app, ["simulate", "--db", f"sqlite:///{tmp_path / 'ledger.db'}", *args])
    assert result.exit_code == 130, result.output
    assert [text for text in result.stderr.splitlines() if text.strip()] == [line]
