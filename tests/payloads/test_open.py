"""Choosing a backend by URL, the default store beside a log, and the package's public names."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

import payloads
from payloads import (
    InMemoryPayloadStore,
    LocalDirPayloadStore,
    PayloadStoreError,
    default_payload_url,
    open_payload_store,
)


def test_each_url_scheme_opens_its_backend(tmp_path: Path) -> None:
    assert isinstance(open_payload_store("memory://"), InMemoryPayloadStore)
    local = open_payload_store((tmp_path / "p").as_uri(), name="shared")
    assert isinstance(local, LocalDirPayloadStore)
    assert (local.root, local.name) == (tmp_path / "p", "shared")
    assert isinstance(open_payload_store(str(tmp_path / "q")), LocalDirPayloadStore)
    with pytest.raises(PayloadStoreError, match="unknown payload store URL 'ftp://x'"):
        open_payload_store("ftp://x")
    # A host in a file URL is never this machine's directory (the path was used, the host dropped).
    with pytest.raises(PayloadStoreError, match=r"names the host 'nas': a directory here is file:///DIR"):
        open_payload_store("file://nas/srv/payloads")
    assert isinstance(open_payload_store(f"file://localhost{tmp_path / 'r'}"), LocalDirPayloadStore)


def test_the_default_store_sits_beside_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEDGER_PAYLOADS", raising=False)
    db = tmp_path / "ledger.db"
    assert default_payload_url(f"sqlite:///{db}") == (tmp_path / "ledger.db.payloads").as_uri()
    assert default_payload_url("sqlite://") == "memory://"
    pg = "postgresql+psycopg://u@127.0.0.1:5432/ledger"
    assert default_payload_url(pg) == pg
    monkeypatch.setenv("LEDGER_PAYLOADS", "s3://bucket/x")
    assert default_payload_url(pg) == "s3://bucket/x"


def test_the_public_names_are_what_the_package_exports() -> None:
    names = {n for n in dir(payloads) if not n.startswith("_")}
    # Submodules imported elsewhere (payloads.token_arrays) are attributes too, not exports.
    assert set(payloads.__all__) == {n for n in names if not isinstance(getattr(payloads, n), ModuleType)}


def test_an_s3_endpoint_without_credentials_is_refused_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the client asks the cloud's instance metadata service (off this host) and retries its
    refusal as an outage for the whole budget."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SKIP_SIGNATURE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    url = "s3://bucket/runs?endpoint=http://127.0.0.1:9&region=us-east-1"
    with pytest.raises(PayloadStoreError, match=r"s3://bucket/runs at http://127.0.0.1:9 has no credentials"):
        open_payload_store(url)
    assert open_payload_store(url + "&skip_signature=true").kind == "s3"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    assert open_payload_store(url).kind == "s3"
