"""`S3PayloadStore`: S3-compatible object storage through obstore (Rust's `object_store`).

Objects are keyed `PREFIX/sha256/<hex>`.  A put is a conditional create (`If-None-Match: *`), so an
object already there is left untouched and counted as stored, as the temporal S3 driver does it by
looking first; S3 acknowledges a PUT once the object is durable.  Every request has a timeout and a
bounded retry (obstore's own backoff with jitter, `max_retries`, `retry_timeout`): nothing waits for
ever.  Credentials come from the usual `AWS_*` environment variables.

    s3://BUCKET/PREFIX?endpoint=http://127.0.0.1:9000&region=us-east-1
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from datetime import timedelta
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import obstore
from obstore import exceptions as oe
from obstore.store import S3Store

from payloads._errors import PayloadStoreError, PayloadStoreUnavailable
from payloads._store import PayloadStore, StoredPayload, check_digest

_ALGORITHM_DIR: Final = "sha256"
# Where the client finds credentials besides the instance metadata service (which only the cloud's own
# S3 answers for): keys given in the URL's query, or the environment.
_CREDENTIAL_OPTIONS: Final = frozenset(
    {
        "aws_access_key_id",
        "access_key_id",
        "aws_skip_signature",
        "skip_signature",
        "aws_web_identity_token_file",
    }
)
_CREDENTIAL_ENV: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SKIP_SIGNATURE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
REQUEST_TIMEOUT_S: Final = 30.0
MAX_RETRIES: Final = 4
RETRY_TIMEOUT_S: Final = 60.0


def _mapped(exc: Exception, what: str) -> PayloadStoreError:
    if isinstance(exc, oe.PermissionDeniedError | oe.UnauthenticatedError | oe.InvalidPathError):
        return PayloadStoreError(f"{what}: {exc}".splitlines()[0])
    return PayloadStoreUnavailable(f"{what}: {exc}".splitlines()[0])


class S3PayloadStore(PayloadStore):
    kind = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        name: str | None = None,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        config: dict[str, Any] = dict(options or {})
        if endpoint:
            if not any(k.lower() in _CREDENTIAL_OPTIONS for k in config) and not any(
                os.environ.get(v) for v in _CREDENTIAL_ENV
            ):
                # Else the client would ask the cloud's instance metadata service (off this host) for
                # credentials an S3-compatible server never accepts, and retry its refusal as an outage.
                raise PayloadStoreError(
                    f"payload store s3://{bucket}/{self.prefix} at {endpoint} has no credentials: set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or skip_signature=true in the URL)"
                )
            config["endpoint"] = endpoint
        if region:
            config["region"] = region
        client: dict[str, Any] = {
            "timeout": timedelta(seconds=REQUEST_TIMEOUT_S),
            "connect_timeout": timedelta(seconds=5),
            "allow_http": bool(endpoint and endpoint.startswith("http://")),
        }
        retry: dict[str, Any] = {
            "max_retries": MAX_RETRIES,
            "retry_timeout": timedelta(seconds=RETRY_TIMEOUT_S),
        }
        try:
            self.client = S3Store(
                bucket,
                prefix=self.prefix or None,
                client_options=client,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
                **config,
            )
        except Exception as exc:
            raise PayloadStoreError(
                f"payload store s3://{bucket}/{self.prefix}: {exc}".splitlines()[0]
            ) from None

    @classmethod
    def from_url(cls, url: str, name: str | None = None) -> S3PayloadStore:
        parts = urlsplit(url)
        if not parts.netloc:
            raise PayloadStoreError(f"payload store URL {url!r} names no bucket")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = query.pop("endpoint", None)
        region = query.pop("region", None)
        return cls(parts.netloc, parts.path, name, endpoint=endpoint, region=region, options=query)

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @staticmethod
    def key_of(digest: str) -> str:
        return f"{_ALGORITHM_DIR}/{check_digest(digest).partition(':')[2]}"

    def put_many(self, items: Mapping[str, bytes]) -> None:
        for digest, content in items.items():
            key = self.key_of(digest)
            try:
                obstore.put(self.client, key, content, mode="create", use_multipart=False)
            except (oe.AlreadyExistsError, oe.PreconditionError):
                self._renew(key, content, digest)  # content-addressed: the same bytes are there
            except Exception as exc:
                raise _mapped(exc, f"storing payload {digest}") from None

    def _renew(self, key: str, content: bytes, digest: str) -> None:
        """The same bytes written again: S3 has no cheaper way to renew an object's time."""
        try:
            obstore.put(self.client, key, content, use_multipart=False)
        except Exception as exc:
            raise _mapped(exc, f"renewing payload {digest}") from None

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for digest in digests:
            try:
                found[digest] = bytes(obstore.get(self.client, self.key_of(digest)).bytes())
            except FileNotFoundError:
                continue
            except oe.NotFoundError:
                continue
            except Exception as exc:
                raise _mapped(exc, f"reading payload {digest}") from None
        return found

    def contains(self, digests: Collection[str]) -> set[str]:
        found: set[str] = set()
        for digest in digests:
            try:
                obstore.head(self.client, self.key_of(digest))
            except (FileNotFoundError, oe.NotFoundError):
                continue
            except Exception as exc:
                raise _mapped(exc, f"looking up payload {digest}") from None
            found.add(digest)
        return found

    def delete(self, digests: Collection[str]) -> int:
        present = self.contains(set(digests))
        if present:
            try:
                obstore.delete(self.client, [self.key_of(d) for d in sorted(present)])
            except Exception as exc:
                raise _mapped(exc, "deleting payloads") from None
        return len(present)

    def scan(self) -> Iterator[StoredPayload]:
        try:
            for chunk in obstore.list(self.client, f"{_ALGORITHM_DIR}/"):
                for meta in chunk:
                    hex_ = str(meta["path"]).rpartition("/")[2]
                    yield StoredPayload(
                        f"sha256:{hex_}", int(meta["size"]), meta["last_modified"].timestamp()
                    )
        except Exception as exc:
            raise _mapped(exc, "listing payloads") from None


__all__ = ["S3PayloadStore"]
