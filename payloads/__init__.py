"""The payload plane: token records, replies, logprobs and continuations, apart from the events.

Events carry a `PayloadClaim` (store, digest, size, media type); the bytes go to a content-addressed
`PayloadStore` before the event that names them is appended.  Backends: `InMemoryPayloadStore` (a test
helper), `LocalDirPayloadStore` (the default beside a SQLite log), `PostgresPayloadStore` (large
values), `S3PayloadStore` (S3-compatible object storage, through obstore).  docs/payloads.md.
"""

from payloads._claim import LOG_BLOBS_STORE, PayloadClaim
from payloads._errors import PayloadCorrupt, PayloadMissing, PayloadStoreError, PayloadStoreUnavailable
from payloads._local import LocalDirPayloadStore
from payloads._memory import InMemoryPayloadStore
from payloads._open import PAYLOADS_ENV, default_payload_url, open_payload_store, payload_url_beside
from payloads._plane import PayloadPlane, verify
from payloads._store import PayloadStore, StoredPayload, check_digest

__all__ = [
    "LOG_BLOBS_STORE",
    "PAYLOADS_ENV",
    "InMemoryPayloadStore",
    "LocalDirPayloadStore",
    "PayloadClaim",
    "PayloadCorrupt",
    "PayloadMissing",
    "PayloadPlane",
    "PayloadStore",
    "PayloadStoreError",
    "PayloadStoreUnavailable",
    "StoredPayload",
    "check_digest",
    "default_payload_url",
    "open_payload_store",
    "payload_url_beside",
    "verify",
]
