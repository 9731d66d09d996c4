"""The directory store's group commit (`payloads._local`): a put of several payloads is durable through
ONE batch file, and a writer SIGKILLed at each step of a batch (reached by a gate) loses nothing it
acknowledged and acknowledged nothing before it was durable, a power loss included (modelled: every
file no sync covered is taken away before the store is opened again)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from payloads import LocalDirPayloadStore, PayloadClaim, PayloadPlane
from payloads._local import BATCH_STEPS, RETIRE_STEPS
from protocol.digests import sha256_digest
from tests.gates import killed_at

_CONTENTS = [f"payload {i} ".encode() * (50 + i) for i in range(4)]


def test_a_batch_is_one_batch_file_and_each_payload_under_its_name(tmp_path: Path) -> None:
    store = LocalDirPayloadStore(tmp_path / "p")
    store.put_many({sha256_digest(c): c for c in _CONTENTS})
    [batch] = list((tmp_path / "p" / "batches").iterdir())
    assert batch.name.endswith(".batch")
    assert store.get_many([sha256_digest(c) for c in _CONTENTS]) == {sha256_digest(c): c for c in _CONTENTS}
    assert {p.digest for p in store.scan()} == {sha256_digest(c) for c in _CONTENTS}  # batch files unlisted
    # A second process does not replay a live writer's batch file.
    other = LocalDirPayloadStore(tmp_path / "p")
    assert batch.exists() and other.get(sha256_digest(_CONTENTS[0])) == _CONTENTS[0]
    store.close()  # retired: one syncfs, the batch file removed
    assert list((tmp_path / "p" / "batches").iterdir()) == []
    assert (
        PayloadPlane(LocalDirPayloadStore(tmp_path / "p")).get(store_claim(store, _CONTENTS[1]))
        == _CONTENTS[1]
    )


def store_claim(store: LocalDirPayloadStore, content: bytes) -> PayloadClaim:
    return PayloadPlane(store).claim(content, "application/octet-stream")


def test_batch_files_are_retired_every_so_many_batches(tmp_path: Path) -> None:
    store = LocalDirPayloadStore(tmp_path / "p")
    store.retire_after_batches = 3
    for i in range(7):
        pair = [f"{i}-a".encode(), f"{i}-b".encode()]
        store.put_many({sha256_digest(c): c for c in pair})
    assert len(list((tmp_path / "p" / "batches").iterdir())) == 1  # 3 + 3 retired, the seventh kept


# A writer process putting one batch of four payloads, stopping at each step (`_local.at_step`)
# until told to go on; it says when the put returned (its ACK), then retires (`close`).
_GATED_WRITER = textwrap.dedent(
    """
    import sys
    from payloads import LocalDirPayloadStore, _local
    from protocol.digests import sha256_digest

    def gate(step):
        print(step, flush=True)
        assert sys.stdin.readline().strip() == "go"

    store = LocalDirPayloadStore(sys.argv[1])
    _local.at_step = gate
    contents = [f"payload {i} ".encode() * (50 + i) for i in range(4)]
    store.put_many({sha256_digest(c): c for c in contents})
    print("acked", flush=True)
    assert sys.stdin.readline().strip() == "go"
    store.close()
    print("closed", flush=True)
    sys.stdin.readline()
    """
)
_ORDER = [*BATCH_STEPS, "acked", *RETIRE_STEPS, "closed"]


def _power_loss(root: Path, seen: list[str], durable: Path) -> None:
    """What a power loss at the last step seen leaves, at worst: every file no sync covered is gone.
    The batch file is durable from `batch_durable` on (its fsync, then its directory's); the
    payloads' own files only once retired (`retire_synced`: one syncfs); temporary files never;
    `durable` (put alone before, synced) always."""
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path == durable:
            continue
        if path.name.startswith(".tmp-"):
            path.unlink()
        elif path.parent.name == "batches":
            if "batch_durable" not in seen:
                path.unlink()
        elif "retire_synced" not in seen:
            path.unlink()


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", _ORDER)
@pytest.mark.parametrize("power_lost", [False, True], ids=["process-killed", "power-lost"])
def test_a_batch_killed_at_each_step_loses_nothing_acknowledged(
    tmp_path: Path, kill_at: str, power_lost: bool
) -> None:
    root = tmp_path / "p"
    earlier = LocalDirPayloadStore(root)
    earlier.put(sha256_digest(b"earlier"), b"earlier")  # the directories exist and are durable
    seen = killed_at(_GATED_WRITER, str(root), kill_at)
    # Every step in order; the ACK only after the batch file is durable.
    assert seen == _ORDER[: len(seen)]
    if power_lost:
        _power_loss(root, seen, earlier.path_of(sha256_digest(b"earlier")))
    digests = [sha256_digest(c) for c in _CONTENTS]
    # A reader that may not write finds what a crash left in a batch file, before any replay.
    reader = LocalDirPayloadStore(root)
    got = reader.get_many(digests)
    assert all(got[d] == c for d, c in zip(digests, _CONTENTS, strict=True) if d in got)  # whole or absent
    if "acked" in seen:
        assert set(got) == set(digests)
    # Reopened writable (the next trainer): replayed, each payload whole under its own name.
    after = LocalDirPayloadStore(root)
    # Every batch file replayed and removed (a temporary one, never named, is a leftover: below).
    assert [p for p in root.glob("batches/*.batch") if not p.name.startswith(".tmp-")] == []
    if "acked" in seen:
        for digest, content in zip(digests, _CONTENTS, strict=True):
            assert after.path_of(digest).read_bytes() == content
        assert {p.digest for p in after.scan()} == {*digests, sha256_digest(b"earlier")}
    assert after.get(sha256_digest(b"earlier")) == b"earlier"
    # Whatever a kill left half-written is a temporary file, which collection removes.
    for leftover in after.leftovers(older_than=float("inf")):
        assert leftover.name.startswith(".tmp-")


def test_a_half_written_batch_file_is_a_leftover_never_replayed(tmp_path: Path) -> None:
    """A batch file killed while it was written keeps its temporary name: the next open replays
    nothing of it (its payloads were never acknowledged) and collection finds it."""
    root = tmp_path / "p"
    store = LocalDirPayloadStore(root)
    store.put_many({sha256_digest(c): c for c in _CONTENTS[:2]})
    store.close()
    half = root / "batches" / ".tmp-1-1-deadbeef.batch"
    half.write_bytes(b'{"payloads":[["sha256:' + b"ab" * 32 + b'",9999]]}\nonly a part')
    again = LocalDirPayloadStore(root)
    assert again.get_many([sha256_digest(c) for c in _CONTENTS[:2]]) == {
        sha256_digest(c): c for c in _CONTENTS[:2]
    }
    assert [p.name for p in again.leftovers(older_than=float("inf"))] == [half.name]
