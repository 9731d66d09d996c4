"""The contract every `PayloadStore` backend passes: one abstract suite, one subclass per backend.

A backend's test module subclasses `PayloadStoreContract` and gives `create_store` (a fresh, empty
store), `reopen` (a second instance on the same storage: what another process would see) and `damage`
(overwrite what is stored under a digest behind the store's back).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from payloads import (
    PayloadClaim,
    PayloadCorrupt,
    PayloadMissing,
    PayloadPlane,
    PayloadStore,
    PayloadStoreError,
)
from protocol.digests import sha256_digest


def item(content: bytes) -> tuple[str, bytes]:
    return sha256_digest(content), content


class PayloadStoreContract:
    def create_store(self) -> PayloadStore:
        raise NotImplementedError

    def reopen(self, store: PayloadStore) -> PayloadStore:
        raise NotImplementedError

    def damage(self, store: PayloadStore, digest: str, content: bytes) -> None:
        raise NotImplementedError

    @pytest.fixture
    def store(self) -> Iterator[PayloadStore]:
        store = self.create_store()
        try:
            yield store
        finally:
            store.close()

    def test_what_is_put_is_got_back_and_listed(self, store: PayloadStore) -> None:
        a, b = item(b"alpha" * 100), item(b"")
        store.put_many(dict([a, b]))
        assert store.get(a[0]) == a[1]
        assert store.get(b[0]) == b""
        assert store.contains([a[0], b[0], sha256_digest(b"nope")]) == {a[0], b[0]}
        listed = {p.digest: p.size for p in store.scan()}
        assert listed == {a[0]: 500, b[0]: 0}

    def test_a_missing_payload_is_left_out_or_raises(self, store: PayloadStore) -> None:
        digest = sha256_digest(b"never stored")
        assert store.get_many([digest]) == {}
        with pytest.raises(PayloadMissing, match="is not stored"):
            store.get(digest)

    def test_a_second_put_of_a_digest_is_a_no_op(self, store: PayloadStore) -> None:
        digest, content = item(b"same")
        store.put(digest, content)
        [first] = list(store.scan())
        store.put_many({digest: content})
        [second] = list(store.scan())
        assert store.get(digest) == content
        assert (first.digest, first.size) == (second.digest, second.size)

    def age(self, store: PayloadStore, digest: str) -> None:
        """Makes the stored payload look put an hour ago."""
        raise NotImplementedError

    def test_a_second_put_renews_the_payloads_time(self, store: PayloadStore) -> None:
        digest, content = item(b"put again")
        store.put(digest, content)
        self.age(store, digest)
        [before] = list(store.scan())
        store.put_many({digest: content})
        [after] = list(store.scan())
        assert after.stored_at > before.stored_at and store.get(digest) == content

    def test_another_instance_sees_what_was_put(self, store: PayloadStore) -> None:
        digest, content = item(bytes(range(256)) * 4096)  # 1 MiB
        store.put(digest, content)
        other = self.reopen(store)
        try:
            assert other.get(digest) == content
        finally:
            if other is not store:
                other.close()

    def test_delete_removes_only_what_it_names(self, store: PayloadStore) -> None:
        keep, drop = item(b"keep"), item(b"drop")
        store.put_many(dict([keep, drop]))
        assert store.delete([drop[0], sha256_digest(b"absent")]) == 1
        assert store.delete([drop[0]]) == 0
        assert store.contains([keep[0], drop[0]]) == {keep[0]}

    def test_a_malformed_digest_is_refused_before_any_io(self, store: PayloadStore) -> None:
        for bad in ("sha256:../../etc/passwd", "md5:abc", "sha256:" + "G" * 64, ""):
            with pytest.raises(PayloadStoreError, match="not a payload digest"):
                store.put(bad, b"x")

    def test_concurrent_puts_of_one_digest_leave_it_whole(self, store: PayloadStore) -> None:
        digest, content = item(b"race" * 50_000)
        errors: list[BaseException] = []

        def put() -> None:
            try:
                store.put(digest, content)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=put) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert store.get(digest) == content
        assert [p.digest for p in store.scan()] == [digest]

    def test_the_plane_checks_what_it_reads_against_the_claim(self, store: PayloadStore) -> None:
        plane = PayloadPlane(store)
        [claim] = plane.put([(b'{"reward": 1.0}', "application/json")])
        assert claim == PayloadClaim(
            store=store.name, digest=sha256_digest(b'{"reward": 1.0}'), size=15, media_type="application/json"
        )
        assert plane.get(claim) == b'{"reward": 1.0}'
        self.damage(store, claim.digest, b'{"reward": 9.0}')
        with pytest.raises(PayloadCorrupt, match="hash to sha256:"):
            plane.get(claim)
        self.damage(store, claim.digest, b"short")
        with pytest.raises(PayloadCorrupt, match="5 bytes stored, the claim says 15"):
            plane.get_many([claim])
        store.delete([claim.digest])
        with pytest.raises(PayloadMissing):
            plane.get(claim)

    def test_a_claim_of_an_unknown_store_is_refused_by_name(self, store: PayloadStore) -> None:
        claim = PayloadClaim(store="elsewhere", digest=sha256_digest(b"x"), size=1, media_type="a/b")
        with pytest.raises(PayloadStoreError, match="'elsewhere', which this process is not configured"):
            PayloadPlane(store).get(claim)
