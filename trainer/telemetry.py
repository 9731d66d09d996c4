"""This process's own performance figures (not in the log): the journal's group-commit batches.

Counts of what happened live in the log (`projections.figures`); how the journal batches them is a
property of this process, measured here and exported beside the log's figures.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Final

from projections.figures import Histogram

# Appends per store transaction, and seconds per transaction (commit and fold).
BATCH_SIZE_BUCKETS: Final = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
BATCH_SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class BatchStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.size = Histogram(BATCH_SIZE_BUCKETS)
        self.seconds = Histogram(BATCH_SECONDS_BUCKETS)

    def observe(self, appends: int, seconds: float) -> None:
        with self._lock:
            self.size.observe(float(appends))
            self.seconds.observe(seconds)

    def copy(self) -> tuple[Histogram, Histogram]:
        with self._lock:
            return self.size.copy(), self.seconds.copy()


JOURNAL_BATCHES: Final = BatchStats()


def journal_families() -> Iterator[Any]:
    """The batches as Prometheus histograms (for `projections.exporter.serve_metrics`'s `extra`)."""
    from projections.exporter import histogram_family

    size, seconds = JOURNAL_BATCHES.copy()
    yield histogram_family(
        "journal_batch_appends", "Appends written per store transaction (group commit).", size
    )
    yield histogram_family(
        "journal_batch_seconds", "Seconds per journal batch: write, commit and fold.", seconds
    )
