"""`protocol.connections.refused_for_good`: libpq's words for a refusal no retry mends, against those
of an outage (the server down, restarting, shutting down, unreachable), which are ridden out."""

from __future__ import annotations

import pytest

from protocol.connections import first_line, refused_for_good

_AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '


@pytest.mark.parametrize(
    "reason",
    [
        'FATAL:  password authentication failed for user "app"',
        'FATAL:  database "ledger" does not exist',
        'FATAL:  role "app" does not exist',
        'FATAL:  no pg_hba.conf entry for host "10.0.0.2", user "app", database "ledger", no encryption',
        'FATAL:  role "app" is not permitted to log in',
        "fe_sendauth: no password supplied",
    ],
)
def test_a_refusal_of_the_connection_itself_is_for_good(reason: str) -> None:
    assert refused_for_good(_AT + reason)


@pytest.mark.parametrize(
    "reason",
    [
        "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?",
        "FATAL:  the database system is starting up",
        "FATAL:  the database system is shutting down",
        "FATAL:  sorry, too many clients already",
        "server closed the connection unexpectedly",
        "timeout expired",
    ],
)
def test_an_outage_is_not(reason: str) -> None:
    assert not refused_for_good(_AT + reason)


def test_the_first_line_of_a_message_that_runs_over_several() -> None:
    assert first_line(OSError("one\n\ttwo")) == "one"
    assert first_line(OSError()) == "OSError"
