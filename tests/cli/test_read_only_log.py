"""`ledger simulate` on a SQLite log it cannot write is refused at once, in one line, as a read-only
payload store is: a read-only file, or a file in a read-only folder (where SQLite keeps its `-wal` and
`-shm` files).

Once the run took the refused writes for an outage, waited out its 30 s budget and advised recovering
"once the database is back".  The tests run as root, who writes through file modes: there the file or
folder is made read-only by a read-only bind mount in a mount namespace of the command's own
(`unshare -m`), as a read-only volume is; as another user, by its modes.  The command runs as a user
runs it: the `ledger` script, in the environment a user has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import pytest

from eventstore import open_store, upgrade_database
from tests.projections.builder import LogBuilder
from tests.userenv import ledger_command, user_env

RUN = ["--groups", "1", "--siblings", "1", "--checkpoint-every", "0"]


def read_only(kind: Literal["file", "folder"], folder: Path) -> list[str]:
    """The prefix that runs a command with `folder/ledger.db` (kind `file`) or `folder` itself, the
    file left writable (kind `folder`), read-only for it."""
    log = folder / "ledger.db"
    if os.geteuid() != 0:
        (log if kind == "file" else folder).chmod(0o444 if kind == "file" else 0o555)
        return []
    if kind == "file":
        script = f'mount --bind "{log}" "{log}" && mount -o remount,bind,ro "{log}" && exec "$@"'
    else:  # the folder read-only, the file itself a writable one bound over it
        writable = folder.parent / "writable.db"
        shutil.copy(log, writable)
        script = (
            f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && '
            f'mount --bind "{writable}" "{log}" && exec "$@"'
        )
    return ["unshare", "-m", "sh", "-c", script, "sh"]


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_log_it_cannot_write_is_refused_at_once_in_one_line(
    tmp_path: Path, kind: Literal["file", "folder"]
) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    log = folder / "ledger.db"
    url = f"sqlite:///{log}"
    upgrade_database(url)
    store = open_store(url)
    LogBuilder(store).clean_sibling_group("earlier", step=1)
    head = store.head()
    store.close()
    for sidecar in folder.glob("ledger.db-*"):  # as a log that was closed cleanly and copied leaves it
        sidecar.unlink()
    prefix = read_only(kind, folder)
    try:
        target = log if kind == "file" else folder / "probe"
        probe = subprocess.run([*prefix, "sh", "-c", f'echo >> "{target}"'], capture_output=True, timeout=60)
        assert probe.returncode != 0, f"the {kind} must be unwritable for this test to mean anything"
        done = subprocess.run(
            [*prefix, ledger_command(), "simulate", "--db", url, *RUN],
            capture_output=True, text=True, cwd=tmp_path, env=user_env(COLUMNS="80"), timeout=300,
        )  # fmt: skip
    finally:
        folder.chmod(0o755)
        log.chmod(0o644)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    what = f"the file {log}" if kind == "file" else f"its folder {folder}"
    assert line.startswith(f"error: database {url} cannot be written here ({what} is read-only"), line
    assert "not retried" in line and "--resume" not in line and "unavailable" not in line, line
    assert "Traceback" not in done.stdout + done.stderr
    store = open_store(url, read_only=True)
    try:
        assert store.head() == head  # nothing was written
    finally:
        store.close()
