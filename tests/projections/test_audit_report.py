"""The audit's JSON report (`ledger audit --json`): every figure under its own name."""

from __future__ import annotations

from projections.audit import AuditReport, Violation
from projections.payload_audit import PayloadAuditSummary


def test_the_report_names_its_events_rules_violations_and_payload_figures() -> None:
    payloads = PayloadAuditSummary(
        claimed=9,
        pruned=1,
        checked=7,
        checked_bytes=4096,
        missing=2,
        corrupt=3,
        log_blobs=5,
        database="sqlite",
    )
    report = AuditReport(
        events=12,
        head=14,
        rules_checked=["a-rule", "b-rule"],
        violations=[Violation(rule="a-rule", positions=[3, 8], message="try p#0 is minted twice")],
        payloads=payloads,
    )
    assert not report.ok
    assert report.as_json() == {
        "events": 12,
        "rules_checked": ["a-rule", "b-rule"],
        "violations": [{"rule": "a-rule", "positions": [3, 8], "message": "try p#0 is minted twice"}],
        "payloads": {
            "claimed": 9,
            "pruned": 1,
            "checked": 7,
            "checked_bytes": 4096,
            "missing": 2,
            "corrupt": 3,
            "log_blobs": 5,
            "database": "sqlite",
        },
    }
    clean = AuditReport(events=0, head=0, rules_checked=[], violations=[])
    assert clean.ok and clean.as_json() == {
        "events": 0,
        "rules_checked": [],
        "violations": [],
        "payloads": None,
    }
