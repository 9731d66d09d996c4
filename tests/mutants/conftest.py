"""The catalogue's report: each mutant refuted in this run, the seeds it took and the violation (read
from the tests' reports, so it works under xdist too)."""

from __future__ import annotations

import pytest

from protocol.mutants import MUTANTS

# mutant -> (seeds run to the first counterexample, the first violation of its check)
REFUTED: dict[str, tuple[int, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "refuted" and isinstance(value, tuple | list):
            name, seeds, found = value
            REFUTED[str(name)] = (int(seeds), str(found))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REFUTED:
        return
    terminalreporter.section("mutant catalogue: seeds to the first counterexample")
    for name, (seeds, found) in sorted(REFUTED.items()):
        m = MUTANTS[name]
        terminalreporter.write_line(f"{name:30} {m.exploration:5} {seeds:4} / {m.budget:<4} {found[:100]}")
