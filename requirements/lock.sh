#!/usr/bin/env bash
# Regenerates requirements/constraints.txt, the lock every install uses (`pip install -c ...`):
# pip-tools resolves pyproject.toml's dependencies and extras for Python 3.11 and pins every package.
# It is a constraints file, not a requirements file, so one lock serves every extra (an install takes
# only what its extras ask for, at the locked version) and any build of torch 2.13.0 (the CPU wheel on
# these machines, the CUDA one elsewhere): the local version label (+cpu) is dropped on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "torch==2.13.0" > "$tmp/pins.in"
(cd "$tmp" && pip-compile --quiet --no-header --strip-extras --no-emit-find-links --no-emit-index-url \
    --extra all --extra dev --extra bench -c "$tmp/pins.in" -o "$tmp/lock.txt" "$OLDPWD/pyproject.toml")
{
    echo "# The lock: every dependency of every extra, pinned.  Regenerate with requirements/lock.sh."
    grep -v -e '^rollout-ledger @' -e '^    # via' -e '^    #   ' "$tmp/lock.txt" | sed -E 's/^torch==([0-9.]+)\+[a-z0-9]+/torch==\1/'
} > requirements/constraints.txt
