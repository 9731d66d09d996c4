"""The mutant catalogue (protocol/mutants.py): every unsafe protocol in it is refuted by the check it is
listed under, within its seed budget.  One test per mutant: its exploration runs seed 0, 1, ... with the
mutant on until a violation of that check appears (the seeds it took are printed at the end of the
run); a mutant that survives its budget fails the run.  The fast slice runs by default (CI); the rest
with `--mutants=all` (docs/testing.md, The mutant catalogue)."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protocol import mutants
from protocol.mutants import MUTANTS
from simulation.explore_store import explore_real
from simulation.explore_turns import check_turns, run_turn_schedule

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "payloads", "eventstore", "projections", "participant", "gym_resources", "trainer")


async def _violations(name: str, seed: int) -> list[str]:
    exploration = MUTANTS[name].exploration
    if exploration == "turns":
        return check_turns(run_turn_schedule(seed))
    result = await explore_real(1, seed)
    return result.violations.get(seed, [])


async def _first_counterexample(name: str) -> tuple[int, list[str]] | None:
    """(seeds run, the violations of the check that refuted it), or None if it survived its budget."""
    mutant = MUTANTS[name]
    with mutants.enabled(name):
        for seed in range(mutant.budget):
            found = [v for v in await _violations(name, seed) if any(w in v for w in mutant.finds)]
            if found:
                return seed + 1, found
    return None


async def _refuted(name: str, record_property: Callable[[str, object], None]) -> None:
    logging.getLogger("simulation").setLevel(logging.CRITICAL)
    refuted = await _first_counterexample(name)
    assert not mutants.active(name)
    assert refuted is not None, f"{name} survived {MUTANTS[name].budget} seeds: {MUTANTS[name].check}"
    seeds, found = refuted
    record_property("refuted", (name, seeds, found[0]))


@pytest.mark.parametrize("name", [n for n, m in MUTANTS.items() if m.fast])
async def test_a_mutant_of_the_fast_slice_is_refuted(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    await _refuted(name, record_property)


@pytest.mark.catalogue
@pytest.mark.parametrize("name", [n for n, m in MUTANTS.items() if not m.fast])
async def test_a_mutant_beyond_the_fast_slice_is_refuted(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    await _refuted(name, record_property)


def _guards() -> dict[str, list[str]]:
    """Every `mutants.active("...")` in the production packages: mutant -> file:function (the innermost
    function holding it) of each."""
    found: dict[str, list[str]] = {}

    class Guards(ast.NodeVisitor):
        def __init__(self, where: str) -> None:
            self.where, self.stack = where, ["<module>"]

        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "active"
                and isinstance(f.value, ast.Name)
                and f.value.id == "mutants"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.setdefault(str(node.args[0].value), []).append(f"{self.where}:{self.stack[-1]}")
            self.generic_visit(node)

    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            Guards(str(path.relative_to(ROOT))).visit(ast.parse(path.read_text(), str(path)))
    return found


def test_every_mutant_has_its_guard_at_a_decision_and_none_is_on() -> None:
    """Each registry entry has a guarded line in the product, each guard names a registered mutant,
    and nothing but `enabled` turns one on (none is on outside it; an unknown name is refused)."""
    # Parsed in a thread of its own: CPython 3.11's AST construction can raise a spurious
    # "recursion depth mismatch" SystemError (cpython gh-106905) in a thread that ran deep code before
    # (this test follows the explorations in one process under `--mutants=all` without xdist).
    with ThreadPoolExecutor(1) as fresh:
        guards = fresh.submit(_guards).result()
    assert set(guards) == set(MUTANTS), {
        "unguarded": set(MUTANTS) - set(guards),
        "unknown": set(guards) - set(MUTANTS),
    }
    assert not any(mutants.active(n) for n in MUTANTS)
    with pytest.raises(KeyError), mutants.enabled("no_such_mutant"):
        pass
    with mutants.enabled("ack_before_durable"):
        assert mutants.active("ack_before_durable") and not mutants.active("claim_while_prepared")
        with pytest.raises(RuntimeError), mutants.enabled("claim_while_prepared"):
            pass
    assert not mutants.active("ack_before_durable")
