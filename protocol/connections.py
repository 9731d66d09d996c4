"""What a database connection's failure says, for the log (eventstore) and the PostgreSQL payload
store (payloads) alike: its first line, and whether trying again can mend it.

A server that is down, restarting or unreachable is an outage: the trainer, the workers and the
payload plane ride it out within their budgets.  A server that answers and refuses this connection
(a wrong password, no such role or database, no pg_hba.conf entry for it) refuses the next one the
same way: waiting out a budget for it only delays the one line that says so.  libpq gives such a
refusal no SQLSTATE (there is no result to carry one), so it is known by the server's and libpq's own
words, in English (`lc_messages` of the server; another language reads as an outage, as before).
"""

from __future__ import annotations

import re
from typing import Final

# The server's refusals at connection (SQLSTATE 28P01, 28000, 3D000) and libpq's own when the server
# asks for a password it was not given.
_REFUSED_FOR_GOOD: Final = re.compile(
    r"authentication failed for user"  # password, ident, peer, ... (28P01 / 28000)
    r"|role \".*\" does not exist"  # 28000
    r"|database \".*\" does not exist"  # 3D000
    r"|no pg_hba\.conf entry for"  # 28000
    r"|is not permitted to log in"  # a role without LOGIN (28000)
    r"|fe_sendauth: no password supplied"
)


def first_line(exc: BaseException | None) -> str:
    """The first line of an error's text (libpq's run over several), else its type's name."""
    return str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else type(exc).__name__


def refused_for_good(message: str) -> bool:
    """Whether a failed connection's `message` is the server refusing this connection itself, which
    no retry mends, rather than an outage."""
    return _REFUSED_FOR_GOOD.search(message) is not None
