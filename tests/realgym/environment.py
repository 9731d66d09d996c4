"""The real-Gym test environment: a Python 3.12 venv with nemo-gym 0.4.0, built once and cached.

The venv lives under `~/.cache/rollout-ledger/realgym/<key>`, the key a hash of the lock file and
the interpreter's version, so a changed lock builds a new one and an unchanged one is reused (the
build takes minutes; a reuse, nothing).  An flock serialises two test processes building at once;
a build that died half-way has no `.complete` mark and is started over.  The servers run this
checkout's `participant` and `protocol` (on their PYTHONPATH, nothing written into the shared
venv); the environment has no torch, so an import of the trainer side or the workers from the
participant would fail there.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[2]
LOCK: Final = Path(__file__).with_name("requirements.lock")
PYTHON_ENV: Final = "REALGYM_PYTHON"  # an explicit 3.12 interpreter
BUILD_TIMEOUT_S: Final = 1500.0
COMPLETE_MARK: Final = ".complete"


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rollout-ledger" / "realgym"


def find_python312() -> str:
    """A Python 3.12 interpreter: $REALGYM_PYTHON, pyenv's 3.12, or python3.12 on PATH."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12.*/bin/python")))
    pyenv += sorted(glob.glob("/root/.pyenv/versions/3.12.*/bin/python"))
    if pyenv:
        return pyenv[-1]
    found = shutil.which("python3.12")
    if found:
        return found
    raise RuntimeError(f"no Python 3.12 found (nemo-gym 0.4.0 needs it); set {PYTHON_ENV}")


def env_key(python: str) -> str:
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    return hashlib.sha256(LOCK.read_bytes() + version.encode()).hexdigest()[:16]


def _build(python: str, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)  # a build that died half-way
    subprocess.run([python, "-m", "venv", str(target)], check=True, timeout=300)
    log = target.parent / f"{target.name}.build.log"
    with open(log, "w") as out:
        # --no-deps: the lock is the whole closure, so the resolver has nothing to decide.
        subprocess.run(
            [str(target / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
             "--no-deps", "-r", str(LOCK)],
            check=True, timeout=BUILD_TIMEOUT_S, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    (target / COMPLETE_MARK).write_text(LOCK.read_text())


def site_packages(env: Path) -> Path:
    [path] = glob.glob(str(env / "lib" / "python3.*" / "site-packages"))
    return Path(path)


def ensure_env() -> Path:
    """The venv's directory, built if needed."""
    python = find_python312()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / env_key(python)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / COMPLETE_MARK).exists():
                _build(python, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def env_python(env: Path) -> str:
    return str(env / "bin" / "python")


if __name__ == "__main__":  # `python -m tests.realgym.environment`: build (or find) it and print where
    print(ensure_env())
    sys.exit(0)
