"""Each backend runs the one contract (tests/payloads/contract.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import obstore
import pytest

from payloads import (
    InMemoryPayloadStore,
    LocalDirPayloadStore,
    PayloadStore,
    PayloadStoreError,
    PayloadStoreUnavailable,
    open_payload_store,
)
from payloads._postgres import TABLE, PostgresPayloadStore
from payloads._s3 import S3PayloadStore
from protocol.digests import sha256_digest
from tests.payloads.contract import PayloadStoreContract
from tests.payloads.s3_server import make_bucket, moto_s3


class TestInMemory(PayloadStoreContract):
    def create_store(self) -> PayloadStore:
        return InMemoryPayloadStore()

    def reopen(self, store: PayloadStore) -> PayloadStore:
        return store  # nothing outlives the instance

    def damage(self, store: PayloadStore, digest: str, content: bytes) -> None:
        assert isinstance(store, InMemoryPayloadStore)
        store.overwrite(digest, content)

    def age(self, store: PayloadStore, digest: str) -> None:
        assert isinstance(store, InMemoryPayloadStore)
        content, at = store._items[digest]
        store._items[digest] = (content, at - 3600)


class TestLocalDir(PayloadStoreContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "payloads"

    def create_store(self) -> PayloadStore:
        return LocalDirPayloadStore(self.root)

    def reopen(self, store: PayloadStore) -> PayloadStore:
        return LocalDirPayloadStore(self.root)

    def damage(self, store: PayloadStore, digest: str, content: bytes) -> None:
        assert isinstance(store, LocalDirPayloadStore)
        store.path_of(digest).write_bytes(content)

    def age(self, store: PayloadStore, digest: str) -> None:
        assert isinstance(store, LocalDirPayloadStore)
        then = time.time() - 3600
        os.utime(store.path_of(digest), (then, then))

    def test_an_unfinished_put_is_never_listed(self, tmp_path: Path) -> None:
        store = LocalDirPayloadStore(self.root)
        store.put("sha256:" + "ab" * 32, b"x")
        shard = self.root / "sha256" / "ab"
        (shard / (".tmp-" + "ab" * 32 + ".dead")).write_bytes(b"half")
        assert [p.digest for p in store.scan()] == ["sha256:" + "ab" * 32]
        assert [p.name for p in store.leftovers(older_than=float("inf"))] == [".tmp-" + "ab" * 32 + ".dead"]

    def test_a_root_that_is_a_file_is_refused_at_open(self) -> None:
        self.root.write_bytes(b"")
        with pytest.raises(PayloadStoreError, match=f"payload store {self.root} is not a directory"):
            LocalDirPayloadStore(self.root)

    def test_a_payload_replaced_by_a_directory_is_not_stored_and_the_others_still_read(self) -> None:
        store = LocalDirPayloadStore(self.root)
        kept, lost = b"kept", b"lost"
        store.put_many({sha256_digest(kept): kept, sha256_digest(lost): lost})
        path = store.path_of(sha256_digest(lost))
        path.unlink()
        path.mkdir()
        assert store.get_many([sha256_digest(kept), sha256_digest(lost)]) == {sha256_digest(kept): kept}
        assert store.contains([sha256_digest(kept), sha256_digest(lost)]) == {sha256_digest(kept)}
        assert [p.digest for p in store.scan()] == [sha256_digest(kept)]  # collection never takes it

    def test_a_directory_gone_after_a_put_is_refused_never_made_again(self) -> None:
        store = LocalDirPayloadStore(self.root)
        store.put(sha256_digest(b"first"), b"first")
        shutil.rmtree(self.root)
        with pytest.raises(PayloadStoreError, match="is gone: the payloads stored in it are lost"):
            store.put(sha256_digest(b"second"), b"second")
        assert not self.root.exists()
        # A process that never saw it (a new run) makes it as the first put does.
        LocalDirPayloadStore(self.root).put(sha256_digest(b"second"), b"second")
        assert LocalDirPayloadStore(self.root).get(sha256_digest(b"second")) == b"second"


class TestPostgres(PayloadStoreContract):
    @pytest.fixture(autouse=True)
    def _url(self, pg_url: str) -> None:
        self.url = pg_url

    def create_store(self) -> PayloadStore:
        return PostgresPayloadStore(self.url)

    def reopen(self, store: PayloadStore) -> PayloadStore:
        return PostgresPayloadStore(self.url)

    def damage(self, store: PayloadStore, digest: str, content: bytes) -> None:
        assert isinstance(store, PostgresPayloadStore)
        with store.engine.connect() as conn:
            raw: Any = conn.connection.dbapi_connection
            with raw.cursor() as cur:
                cur.execute(f"UPDATE {TABLE} SET content = %s WHERE digest = %s", (content, digest))
            raw.commit()

    def age(self, store: PayloadStore, digest: str) -> None:
        assert isinstance(store, PostgresPayloadStore)
        with store.engine.connect() as conn:
            raw: Any = conn.connection.dbapi_connection
            with raw.cursor() as cur:
                cur.execute(f"UPDATE {TABLE} SET stored_at = stored_at - 3600 WHERE digest = %s", (digest,))
            raw.commit()

    def test_a_put_past_one_statement_stores_every_payload_with_its_size(self) -> None:
        store = PostgresPayloadStore(self.url)
        try:
            items = {sha256_digest(b"%d" % i): b"%d" % i for i in range(2_345)}  # three statements
            store.put_many(items)
            store.put_many(dict(list(items.items())[:10]))  # already there: left as they are
            assert store.get_many(list(items)) == items
            sizes = {p.digest: p.size for p in store.scan()}
            assert all(sizes[d] == len(c) for d, c in items.items())
        finally:
            store.close()

    def test_large_payloads_go_to_libpq_uncopied_and_read_back_byte_for_byte(self) -> None:
        from psycopg.adapt import PyFormat

        from payloads._postgres import _payload_dumper

        store = PostgresPayloadStore(self.url)
        try:
            # Past glibc's 64 KiB mmap threshold, a view and a bytearray among them (put_many takes
            # any buffer), every byte value present.
            contents: list[bytes | bytearray] = [
                bytes(range(256)) * 300,
                bytearray(b"\0\xff" * 50_000),
                b"x" * 70_001,
            ]
            items = {sha256_digest(bytes(c)): c for c in contents}
            given: dict[str, bytes | bytearray | memoryview] = {
                d: memoryview(c) if i == 0 else c for i, (d, c) in enumerate(items.items())
            }
            store.put_many(cast(Mapping[str, bytes], given))  # typed bytes; any buffer is what is checked
            assert store.get_many(list(items)) == {d: bytes(c) for d, c in items.items()}
            dumper = _payload_dumper()
            with store.engine.connect() as conn:
                raw: Any = conn.connection.dbapi_connection
                with raw.cursor() as cur:
                    cur.adapters.register_dumper(bytes, dumper)
                    assert cur.adapters.get_dumper(bytes, PyFormat.BINARY) is dumper  # not psycopg's C one
                    assert dumper(bytes).dump(contents[2]) is contents[2]  # the object itself, no copy
        finally:
            store.close()

    def test_a_server_that_is_not_there_is_unavailable(self) -> None:
        store = PostgresPayloadStore("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2")
        try:
            with pytest.raises(PayloadStoreUnavailable):
                store.put("sha256:" + "0" * 64, b"x")
        finally:
            store.close()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as endpoint:
        yield endpoint


class TestS3(PayloadStoreContract):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        self.endpoint = s3_endpoint
        self.bucket = f"b{uuid.uuid4().hex[:12]}"
        make_bucket(s3_endpoint, self.bucket)

    def create_store(self) -> PayloadStore:
        return open_payload_store(f"s3://{self.bucket}/runs/one?endpoint={self.endpoint}&region=us-east-1")

    def reopen(self, store: PayloadStore) -> PayloadStore:
        return self.create_store()

    def damage(self, store: PayloadStore, digest: str, content: bytes) -> None:
        assert isinstance(store, S3PayloadStore)
        obstore.put(store.client, store.key_of(digest), content)  # an unconditional overwrite

    def age(self, store: PayloadStore, digest: str) -> None:
        # An object's time is the server's to set, to the second (moto's too): let one second pass.
        time.sleep(1.1)

    def test_an_endpoint_that_is_not_there_is_unavailable(self) -> None:
        store = S3PayloadStore("nobucket", endpoint="http://127.0.0.1:1", region="us-east-1")
        with pytest.raises(PayloadStoreUnavailable):
            store.put("sha256:" + "0" * 64, b"x")


def test_a_put_past_the_file_size_limit_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """`ulimit -f` (EFBIG) in a real subprocess: refused for good, in one line, and no part-written
    temporary file is left (a full disk, retried within the outage budget, left one per try)."""
    script = (
        "import resource, sys\n"
        "from payloads import LocalDirPayloadStore, PayloadStoreError, PayloadStoreUnavailable\n"
        "from protocol.digests import sha256_digest\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "content = bytes(64 * 1024)\n"
        "try:\n"
        "    LocalDirPayloadStore(sys.argv[1]).put(sha256_digest(content), content)\n"
        "except PayloadStoreUnavailable as exc:\n"
        "    print('unavailable:', exc)\n"
        "except PayloadStoreError as exc:\n"
        "    print('refused:', exc)\n"
    )
    root = tmp_path / "payloads"
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"refused: storing payloads under {root}: File too large"], (
        done.stdout
    )
    assert [p.name for p in root.rglob("*") if p.is_file()] == []
