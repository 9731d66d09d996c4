"""`ledger simulate`'s verdict is `ledger audit`'s whole audit, the payload rules included.

Once the run's summary audited the log without its payload plane: a payload deleted or altered under
`ledger.db.payloads/` left `ledger simulate` printing PASS (exit 0) while `ledger audit` on the same
log exited 1.  The commands run as a user runs them: the `ledger` script, in the environment a user has.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from eventstore import open_store
from eventstore.events import RunReplied
from payloads import LocalDirPayloadStore
from projections.payload_audit import PAYLOAD_INTACT, PAYLOAD_RULES, PAYLOAD_STORED
from tests.userenv import ledger_command, user_env

RUN = ["--groups", "3", "--siblings", "2", "--checkpoint-every", "0", "--faults", "", "--json"]


def ledger(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ledger_command(), *args],
        capture_output=True, text=True, cwd=tmp_path, env=user_env(COLUMNS="200"), timeout=300,
    )  # fmt: skip


def reply_digests(url: str) -> list[str]:
    """The digests of the replies the log's runs stored (each names its try: no later run puts them)."""
    store = open_store(url)
    try:
        found = []
        for event in store.read_all(0, types=[RunReplied.event_type()]):
            reply = event.decode()
            assert isinstance(reply, RunReplied) and reply.reply is not None
            found.append(reply.reply.digest)
        return found
    finally:
        store.close()


def test_a_payload_lost_or_altered_fails_the_next_run_as_it_fails_the_audit(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first = ledger(tmp_path, "simulate", "--db", url, *RUN)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    clean = json.loads(first.stdout)
    assert clean["verdict"].startswith("PASS"), clean["verdict"]

    store = LocalDirPayloadStore(tmp_path / "ledger.db.payloads")
    lost, altered = reply_digests(url)[:2]
    store.path_of(lost).unlink()
    path = store.path_of(altered)
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(bytes(content))

    second = ledger(tmp_path, "simulate", "--db", url, *RUN)
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    summary = json.loads(second.stdout)
    assert summary["stranded"] == 0 and summary["duplicate_executions"] == 0  # the run itself was clean
    assert summary["audit_violations"] >= 2, summary
    assert {PAYLOAD_STORED, PAYLOAD_INTACT} <= set(summary["audit_rules_broken"]), summary
    assert summary["verdict"].startswith("FAIL: 0 stranded, 0 duplicate executions, "), summary["verdict"]
    audit = ledger(tmp_path, "audit", "--db", url, "--json")
    assert audit.returncode == 1, audit.stdout[-2000:]
    audited = json.loads(audit.stdout)
    assert len(audited["violations"]) == summary["audit_violations"]
    # Every rule `ledger audit` checks, the payload rules among them, and the verdict says how many.
    assert clean["audit_rules"] == summary["audit_rules"] == len(audited["rules_checked"])
    assert set(PAYLOAD_RULES) <= set(audited["rules_checked"])
    assert f"({clean['audit_rules']} rules)" in clean["verdict"]
