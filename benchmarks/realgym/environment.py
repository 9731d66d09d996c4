"""The real Gym's environment (tests/realgym, benchmarks.peer): pyenv's Python 3.13.0 with nemo-gym 0.7.0,
built once and cached.

nemo-gym 0.7.0 (the newest release) declares Requires-Python >=3.13.14; it installs and runs on 3.13.0,
which pyenv provides here, with `--ignore-requires-python`.  The venv is built from `requirements.lock`
(the whole set 0.7.0 resolves to, pinned) with `--no-deps`, so the build decides nothing.  It lives
under `~/.cache/rollout-ledger/realgym/<key>`, the key a hash of the lock file and the interpreter's
version, so a changed lock builds a new one and an unchanged one is reused (the build takes about two
minutes; a reuse, nothing).  An flock serialises two processes building at once; a build that
died half-way has no `.complete` mark and is started over.  A machine without Python 3.13.0 fails
here, loudly: the real-Gym suite is never skipped.  The servers run this checkout's `participant` and
`protocol` (on their PYTHONPATH, nothing written into the shared venv); the environment has no torch,
so an import of the trainer side or the workers from the participant would fail there.
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
PYTHON_ENV: Final = "REALGYM_PYTHON"  # an explicit Python 3.13.0 interpreter
PYTHON_VERSION: Final = "3.13.0"
BUILD_TIMEOUT_S: Final = 1500.0
COMPLETE_MARK: Final = ".complete"


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rollout-ledger" / "realgym"


def _pyenv_prefix() -> str | None:
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    done = subprocess.run(
        [pyenv, "prefix", PYTHON_VERSION], capture_output=True, text=True, timeout=60, check=False
    )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def find_python() -> str:
    """Python 3.13.0: $REALGYM_PYTHON, else `pyenv prefix 3.13.0`, else pyenv's usual homes.
    RuntimeError (the suite fails, never skips) when there is none."""
    candidates = [os.environ.get(PYTHON_ENV) or ""]
    prefix = _pyenv_prefix()
    if prefix:
        candidates.append(f"{prefix}/bin/python")
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += [
        f"{root}/versions/{PYTHON_VERSION}/bin/python",
        f"/root/.pyenv/versions/{PYTHON_VERSION}/bin/python",
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        f"no Python {PYTHON_VERSION} for the real-Gym suite (nemo-gym 0.7.0 runs on it): "
        f"`pyenv install {PYTHON_VERSION}`, or set {PYTHON_ENV}"
    )


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
             "--no-deps", "--ignore-requires-python", "-r", str(LOCK)],
            check=True, timeout=BUILD_TIMEOUT_S, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    (target / COMPLETE_MARK).write_text(LOCK.read_text())


def site_packages(env: Path) -> Path:
    [path] = glob.glob(str(env / "lib" / "python3.*" / "site-packages"))
    return Path(path)


def ensure_env() -> Path:
    """The venv's directory, built if needed."""
    python = find_python()
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


if __name__ == "__main__":  # `python -m benchmarks.realgym.environment`: build (or find) it and print where
    print(ensure_env())
    sys.exit(0)
