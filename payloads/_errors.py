"""The payload plane's one short list of errors: every backend maps its own onto these."""

from __future__ import annotations


class PayloadStoreError(Exception):
    """A payload store refused or failed an operation for good (bad configuration, permissions)."""


class PayloadMissing(PayloadStoreError):
    """No payload is stored under the digest asked for."""

    def __init__(self, digest: str, store: str = "") -> None:
        where = f" in payload store {store!r}" if store else ""
        super().__init__(f"payload {digest} is not stored{where}")
        self.digest = digest


class PayloadCorrupt(PayloadStoreError):
    """What is stored under a digest does not hash to it (or has another size than its claim)."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"payload {digest} is corrupt: {reason}")
        self.digest = digest


class PayloadStoreUnavailable(PayloadStoreError):
    """The store cannot be reached now (connection, timeout, a full disk): worth retrying within a budget."""


__all__ = ["PayloadCorrupt", "PayloadMissing", "PayloadStoreError", "PayloadStoreUnavailable"]
