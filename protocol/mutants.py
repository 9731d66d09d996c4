"""Unsafe protocols, each one switch away: the test-only seam of the mutant catalogue.

A mutant is a small change to one decision of the protocol, one the verification (the explorations'
checkers, the audit's rules) must refute.  Its registry entry is here (`MUTANTS`: what it breaks, which
exploration must refute it and by which check, its seed budget), and its guarded line sits at the
decision, always in one form:

    if mutants.active("ack_before_durable"):
        ...  # the unsafe variant

Nothing a user can reach turns one on: no command, environment variable or setting reads this module's
state.  Only test code flips it, in-process, with `enabled` (tests/mutants/test_catalogue.py); every
process an exploration plays (trainers, agents) runs in that same process.  With none on, `active` is
one test of an empty set.  docs/testing.md, The mutant catalogue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Literal

# The seeded explorations a mutant is refuted by (simulation/): `real` the real coordinator over SQLite
# (`explore_store`), `turns` turn-level resume (`explore_turns`).
Exploration = Literal["real", "turns"]


@dataclass(frozen=True)
class Mutant:
    summary: str  # the unsafe protocol, in a line
    exploration: Exploration
    # The check that must refute it, in words, and the words one of whose violations must carry
    # (a mutant refuted by some other check's noise is not refuted by the one it is listed under).
    check: str
    finds: tuple[str, ...]
    # Seeds of its exploration (from 0) it may survive before the catalogue fails.
    budget: int
    # In the fast slice, which every test run (CI's too) includes; the rest run with `--mutants=all`.
    fast: bool = True


MUTANTS: Final[Mapping[str, Mutant]] = {
    "pg_debt_at_group_seal": Mutant(
        "prompt_group: a held sibling's ACK debt is recorded only when the whole group seals",
        "real",
        "audit debt-with-result (no-stranded-result, once its group fails)",
        ("debt-with-result", "no-stranded-result"),
        10,
    ),
    "replace_without_retire": Mutant(
        "a lost reply answered by minting the next try, the old one neither retired nor adopted",
        "real",
        "audit retire-before-replace",
        ("retire-before-replace",),
        10,
    ),
    "ack_before_durable": Mutant(
        "the ACK sent before the seal and its debt are durable in the log",
        "real",
        "checker: every /acknowledge names only receipts whose AckOwed the log already holds",
        ("before its AckOwed was durable",),
        10,
    ),
    "debt_dropped_without_evidence": Mutant(
        "an unknown_execution drops the debt without the agent's incarnation as evidence",
        "real",
        "audit debt-dropped-on-evidence",
        ("debt-dropped-on-evidence",),
        60,
    ),
    "commit_with_unpaid_debt": Mutant(
        "a checkpoint committed while a debt is unpaid at its cut (no flush, no check at the decision)",
        "real",
        "audit checkpoint-clean",
        ("checkpoint-clean",),
        40,
        fast=False,
    ),
    "stale_owner_unfenced": Mutant(
        "a stale owner's appends (and the /run each RunDispatched gates) not fenced by the owner epoch",
        "real",
        "audit owner-epoch; checker: a claim by a superseded owner",
        ("owner-epoch", "superseded owner"),
        120,
        fast=False,
    ),
    "adopt_unverified": Mutant(
        "an adopted reply not checked against the receipt's digest",
        "real",
        "audit receipt-matches (adopt replies altered in flight: `Plan.tamper`)",
        ("receipt-matches",),
        40,
    ),
    "agent_forgets_tombstones": Mutant(
        "a restarted agent forgets the tries an earlier process of its state directory recorded",
        "real",
        "checker: a try ran after an earlier generation retired it, or twice",
        ("after generation", "executed 2 times"),
        130,
        fast=False,
    ),
    "payload_pruned_while_claimed": Mutant(
        "retention prunes the payloads of every group, live ones and those no committed cut covers",
        "real",
        "checker: every payload of a group not done for good is still stored after the operator's "
        "prune and collect",
        ("payload(s) of live group",),
        10,
    ),
    "mutation_key_ignored": Mutant(
        "a resumed turn re-applies a resource mutation (its idempotency key ignored)",
        "turns",
        "checker: a side effect twice, or a bank session without exactly one deposit per turn",
        ("side effect twice", "not one deposit per turn"),
        70,
    ),
    "resume_superseded_boundary": Mutant(
        "a continuation resumed from a boundary the lineage's durable turns no longer hold as its "
        "furthest (a stale owner's earlier boundary)",
        "turns",
        "checker: a completed turn generated again on its lineage",
        ("generated again",),
        130,
    ),
    "claim_while_prepared": Mutant(
        "a claim for training accepted for a group while a checkpoint is prepared and undecided",
        "real",
        "audit no-claim-while-prepared",
        ("no-claim-while-prepared",),
        10,
    ),
}

_on: set[str] = set()


def active(name: str) -> bool:
    """Whether the mutant `name` is switched on (by a test, in this process)."""
    if not _on:
        return False
    if name not in MUTANTS:
        raise KeyError(f"no mutant {name!r} in protocol.mutants.MUTANTS")
    return name in _on


@contextlib.contextmanager
def enabled(name: str) -> Iterator[None]:
    """Switches the mutant `name` on for the block (test code only; one at a time)."""
    if name not in MUTANTS:
        raise KeyError(f"no mutant {name!r} in protocol.mutants.MUTANTS")
    if _on:
        raise RuntimeError(f"mutant {sorted(_on)[0]!r} is already on: one at a time")
    _on.add(name)
    try:
        yield
    finally:
        _on.discard(name)


__all__ = ["MUTANTS", "Exploration", "Mutant", "active", "enabled"]
