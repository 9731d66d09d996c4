"""A projection runner in its own process, for the SIGKILL test: `python -m tests.projections.runner_proc URL N`."""

from __future__ import annotations

import sys

from eventstore import open_store
from projections.runner import ProjectionRunner


def main(url: str, every: int) -> None:
    store = open_store(url)
    ProjectionRunner(store, checkpoint_every=every, keep=5).run(idle_exit_s=0.5)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
