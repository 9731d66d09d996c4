"""The soak at two sizes on a real PostgreSQL, tiny: its JSON holds the headline figures, and the
figures that follow from the sizes move with them (speed is what running it measures, not checked)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import soak
from eventstore import open_store, upgrade_database
from eventstore.events import RunReplied
from eventstore.payload_stores import payload_plane
from projections.audit import RULES
from projections.payload_audit import PAYLOAD_RULES, PAYLOAD_STORED
from protocol.streams import group_stream
from tests.projections.builder import LogBuilder
from tests.userenv import ledger_command, user_env
from tests.workers.tries import seal_group
from workers.policy import DEFAULT_POLICY_SPEC, load_policy


def run(pg_url: str, tmp_path: Path, name: str, *sizes: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    argv = ["--db", pg_url, "--groups", "6", "--siblings", "2", "--agents", "1", "--faults", ""]
    argv += ["--checkpoint-every", "0.5", "--sample-every", "0.05", "--json", str(out), *sizes]
    assert soak.main(argv) == 0  # nothing stranded, no duplicate, the audit clean
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_the_soak_reports_sizes_bytes_cpu_and_memory_that_move_with_the_knobs(
    pg_url: str, tmp_path: Path
) -> None:
    tiny = run(pg_url, tmp_path, "tiny")
    sizes = ("--prompt-tokens", "1500", "--gen-tokens", "1000", "--turns", "2")
    real = run(pg_url, tmp_path, "real", *sizes)
    for result in (tiny, real):
        assert set(soak.HEADLINE) <= set(result), sorted(result)
        assert result["throughput"]["sealed_rollouts"] == 12
        assert result["sizes"]["token_sample"] == 12  # every sealed rollout read back
        for key in ("trainer_cpu_ms_per_rollout", "events_bytes_per_rollout", "payload_bytes_per_rollout"):
            assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
        assert isinstance(result["trainer_rss_growth_pct"], float | int)
        assert isinstance(result["heap_trims"], int) and result["heap_trims"] >= 0
        assert {"trainer", "agent-0"} <= set(result["cpu_s"])
    # tiny: a prompt of 5-11 and one call of 1-3 tokens
    assert 6 <= tiny["tokens_per_rollout"] <= 14
    # two calls: the prompt (1000-2000), the first generation (667-1333), then the second call is
    # sent all that and an observation, and generates as much again
    assert 2 * 1000 + 2 * 667 <= real["tokens_per_rollout"] <= 2 * 2000 + 3 * 1333 + 6
    # Payloads grow with the tokens (random ids over a vocabulary of 512 cannot take under a byte
    # each in any encoding); the events table does not hold them.
    assert real["payload_bytes_per_rollout"] >= real["tokens_per_rollout"]
    assert real["payload_bytes_per_rollout"] > 10 * tiny["payload_bytes_per_rollout"]
    assert real["events_bytes_per_rollout"] < 0.2 * real["payload_bytes_per_rollout"]
    per_token = real["payload_bytes_per_rollout"] / real["tokens_per_rollout"]
    assert real["payload_bytes_per_token"] == pytest.approx(per_token, rel=0.01)

    # `--inline-tokens`: the reply carries every call's arrays as JSON, as a real Gym agent's does
    # (more than two bytes of text a token); the trainer seals each try from it (nothing stranded, the
    # audit clean, every reply stored apart made whole against its receipt: `run` checks) and stores
    # the reply apart from the arrays its binary records hold: the same bytes a token, within the
    # draws' spread, as the agent that sends the records apart.
    inline = run(pg_url, tmp_path, "inline", *sizes, "--inline-tokens")
    assert inline["sizes"]["inline_tokens"] is True and real["sizes"]["inline_tokens"] is False
    assert inline["throughput"]["sealed_rollouts"] == 12
    assert inline["tokens_per_rollout"] == pytest.approx(real["tokens_per_rollout"], rel=0.2)
    assert inline["payload_bytes_per_token"] == pytest.approx(real["payload_bytes_per_token"], rel=0.15)
    assert inline["payload_bytes_per_token"] < per_token + 1.0


@pytest.mark.parametrize("option", ["--groups", "--siblings", "--agents", "--window", "--pool-size"])
def test_a_count_below_one_is_refused_in_one_line(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        soak.main([option, "0"])
    assert refused.value.code == 2
    assert f"argument {option}: 0 is not at least 1" in capsys.readouterr().err


def test_a_payload_store_it_cannot_use_is_one_line(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LEDGER_PAYLOADS", "ftp://x")
    assert soak.main(["--db", pg_url, "--groups", "1", "--siblings", "1", "--faults", ""]) == 2
    err = capsys.readouterr().err
    assert "error: unknown payload store URL 'ftp://x'" in err and "Traceback" not in err, err


def test_the_soaks_verdict_is_the_whole_audit_payloads_included(pg_url: str, tmp_path: Path) -> None:
    """On a log where a claimed payload is gone (an earlier run's, deleted from the payload store), the
    soak fails as `ledger audit` does: its audit runs the payload rules too (it once ran 21 rules,
    none of them the payloads', and passed)."""
    upgrade_database(pg_url)
    store = open_store(pg_url)
    try:
        plane = payload_plane(store)
        LogBuilder(store, payloads=plane).clean_sibling_group("earlier", step=1)
        replies = [e.decode() for e in store.read_stream(group_stream("earlier")) if e.type == "RunReplied"]
        [lost, *_] = [r.reply.digest for r in replies if isinstance(r, RunReplied) and r.reply is not None]
        assert plane.default.delete([lost]) == 1
    finally:
        store.close()
    out = tmp_path / "soak.json"
    argv = ["--db", pg_url, "--groups", "1", "--siblings", "2", "--agents", "1", "--faults", ""]
    assert soak.main([*argv, "--checkpoint-every", "0", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["summary"]["stranded"] == 0 and result["summary"]["duplicate_executions"] == 0
    assert result["audit"]["rules_checked"] == len(RULES) + len(PAYLOAD_RULES)
    assert result["audit"]["by_rule"] == {PAYLOAD_STORED: 1}, result["audit"]


def test_the_token_sample_leaves_out_what_a_prune_removed_during_the_run(tmp_path: Path) -> None:
    """`ledger payloads prune` while a soak runs removes some of the run's token records (recorded as
    `PayloadsPruned`): the soak's closing sample reads the others and counts those, where it once
    read them all and crashed on the first one gone, printing no summary.  The run's groups are
    sealed with real token records, trained and archived; the prune is the real command."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade_database(url)
    store = open_store(url)
    try:
        policy = load_policy(DEFAULT_POLICY_SPEC)
        log = LogBuilder(store)
        for step in range(1, 4):
            seal_group(store, policy, f"soakrun-p{step}", 2)
            log.claim(f"soakrun-p{step}", step)
            log.checkpoint(f"c{step}")
        log.checkpoint("c4")
        before = soak.sealed_tokens(store, "soakrun")
        assert (before.size, before.pruned) == (6, 0) and before.mean > 0
        prune = ["payloads", "prune", "--db", url, "--grace-s", "0", "--unscored", "--keep-newest", "1"]
        pruned = subprocess.run(
            [ledger_command(), *prune],
            capture_output=True, text=True, env=user_env(COLUMNS="200"), cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert pruned.returncode == 0 and "pruned 2 done group(s)" in pruned.stdout, (
            pruned.stdout + pruned.stderr
        )
        after = soak.sealed_tokens(store, "soakrun")
        assert (after.size, after.pruned) == (2, 4) and after.mean > 0
    finally:
        store.close()
