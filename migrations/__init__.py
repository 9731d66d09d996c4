"""Schema migrations (alembic).  PL/pgSQL functions live in `functions/<name>.<revision>.sql`.

A function's file is named for the revision that created or replaced it and is never edited after:
a migration loads the file of its own revision on upgrade and the previous revision's file on
downgrade, so each revision keeps creating the function exactly as it was then.
"""

from __future__ import annotations

from pathlib import Path

FUNCTIONS = Path(__file__).parent / "functions"


def function_sql(name: str, revision: str) -> str:
    """The `CREATE FUNCTION` text of `name` as revision `revision` defines it."""
    return (FUNCTIONS / f"{name}.{revision}.sql").read_text(encoding="utf-8")
