"""`ledger console`: a live, read-only web console over the log (docs/console.md).

    guard, shell = create_app(store, ConsoleConfig(url=url))   # an ASGI app; uvicorn serves it

The overview is folded incrementally from the log's subscription and pushed to open pages as
server-sent events; groups, one rollout (swimlane, tries, payloads decoded through the payload
plane's checked reads), checkpoints, the samples of a train step and the audit are pages rendered
on the server from the same fold and the log's indexes.  Every route is a GET; the log is opened
read-only (the auditor role when `LEDGER_AUDITOR_DB` is set).

_fold         the live state: projections, counts, rates, debt ages, folded a page at a time
_live         the follower thread and the change signal the overview's pushes wait on
_overview     the overview's view (pure)
_groups       group filters, pages of groups, the samples of a train step (pure)
_rollout      one sibling across its tries, and a try's payloads decoded (pure)
_checkpoints  the checkpoints list and one checkpoint's detail (pure)
_reads        the console's own indexed reads of the log
_jobs         the audit and replay --verify, each in a process of its own
_guard        token, GET-only and security headers, in front of every route
_app          the FastAPI routes and Jinja2 pages
_serve        `ledger console`: bind, serve, stop
"""

from console._app import ZOOMS, Console, ConsoleConfig, create_app
from console._fold import FoldStopped, LiveFold
from console._serve import CONSOLE_TOKEN_ENV, DEFAULT_HOST, DEFAULT_PORT, serve

__all__ = [
    "CONSOLE_TOKEN_ENV",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "ZOOMS",
    "Console",
    "ConsoleConfig",
    "FoldStopped",
    "LiveFold",
    "create_app",
    "serve",
]
