"""`ledger simulate --resources ... --compare-level ...`: the options refuse bad input in one line; a
second run at the other level is made of the same options; a run whose agents call the reference
resources server counts the side effects from its journal (none twice)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from cli.simulate import _config, _options
from eventstore import open_store
from simulation.run import SimConfig, failed, run_simulation

cli = CliRunner()


def test_bad_levels_and_resources_are_one_line_errors(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'l.db'}"
    for args, words in (
        (["--compare-level", "step"], "--compare-level must be turn, sibling or prompt_group"),
        (["--resources", "bank,vault"], "--resources names vault"),
        (["--compare-level", "sibling", "--resume", "s123"], "not with --ray or --resume"),
    ):
        result = cli.invoke(app, ["simulate", "--db", db, *args])
        text = " ".join(w for w in result.output.split() if w.strip("│╭╮╰╯─"))  # inside rich's box
        assert result.exit_code == 2 and words in text, result.output
        assert "Traceback" not in result.output


def test_the_compared_run_is_made_of_the_same_options_at_the_other_level() -> None:
    first = _config(
        agents=1, groups=5, siblings=2, mode="sibling", target_level="turn", turns=(3, 6),
        kill_trainer_every_s=3.0, resources="bank", measure_turns=True, rollout_timeout_s=None, run_id=None,
    )  # fmt: skip
    other = _config(**{**_options(first), "target_level": "sibling"}, run_id=None)
    assert other.run_id != first.run_id and other.agent_state_root != first.agent_state_root
    differ = {
        f.name for f in dataclasses.fields(SimConfig) if getattr(first, f.name) != getattr(other, f.name)
    }
    assert differ == {"run_id", "agent_state_root", "target_level"}
    assert "--turn-continuation" in other.agent_args()  # what the other level redoes is counted too


async def test_a_run_whose_turns_call_the_resources_counts_their_side_effects(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'l.db'}", migrate_schema=True)
    try:
        config = SimConfig(
            agents=1, groups=2, siblings=2, mode="sibling", faults="", turns=(2, 3), target_level="turn",
            resources="bank,calculator", run_id="res1", agent_state_root=tmp_path / "agents",
            checkpoint_every_s=60.0,
        )  # fmt: skip
        summary = await run_simulation(store, config)
    finally:
        store.close()
    # Every episode has 2 or 3 turns: a deposit after each but the last, on its own lineage's session.
    assert 4 <= summary["side_effects_applied"] <= 8
    assert summary["side_effects_twice"] == 0 and summary["side_effects_reverted"] == 0
    assert not failed(summary) and summary["groups_sealed"] == 2
    assert failed({**summary, "side_effects_twice": 1})  # a key whose effect stands twice fails the run
