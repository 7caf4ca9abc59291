"""The conformance suite every tier passes: the whole contract of ``tiercache/tiers/base.py``.

A tier's test module subclasses :class:`TierConformance` and provides the ``tier`` fixture (a
fresh, empty tier per test); it may override :meth:`TierConformance.backing_state` to let the
invalid-key tests check the backing storage itself, not only what the tier lists.
"""

from __future__ import annotations

import mmap
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiercache.errors import ConflictError, InvalidNameError
from tiercache.tiers.base import Buffer, RefValue, Tier

MIB = 1 << 20
SIZES = [0, 1, 4095, 4096, 4097, 3 * MIB + 17]
SOURCE_KINDS = ["bytes", "bytearray", "memoryview", "aligned", "unaligned"]
KEY = "chunks/ab/ab0123456789abcdef0123456789abcdef"
BAD_KEYS = [
    "../x",
    "a//b",
    "/abs",
    ".tmp-x",
    "chunks/.tmp-x",
    "a/" + "x" * 129,
    "",
    "a/",
    "a/../../b",
    "a/b c",
]


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes (no runs a short read could hide in)."""
    return random.Random(seed).randbytes(n)


def page_aligned(n: int, *, shift: int = 0) -> memoryview:
    """A writable buffer of ``n`` bytes starting ``shift`` bytes after a page boundary."""
    return memoryview(mmap.mmap(-1, n + shift + 1))[shift : shift + n]


def source(kind: str, data: bytes) -> Buffer:
    """``data`` in one of the buffer kinds ``put`` accepts."""
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(bytearray(data))
    buf = page_aligned(len(data), shift=0 if kind == "aligned" else 1)
    buf[:] = data
    return buf


def run_threads(fn: Callable[[int], object], n: int) -> list[object]:
    """Run ``fn(i)`` for ``i in range(n)`` on ``n`` threads; re-raise the first error."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        return [f.result() for f in [pool.submit(fn, i) for i in range(n)]]


class TierConformance:
    """Contract tests for every tier.

    Not collected itself (no ``Test`` prefix); each ``Test*Conformance`` subclass defines the
    ``tier`` fixture that yields a fresh, empty tier of its kind, which every test here uses.
    """

    def backing_state(self, tier: Tier) -> object:
        """Everything the tier stores, for checking that a refused call touched nothing."""
        return tier.list()

    # ------------------------------------------------------------------ objects

    @pytest.mark.parametrize("kind", SOURCE_KINDS)
    @pytest.mark.parametrize("size", SIZES)
    def test_put_get_roundtrip(self, tier: Tier, size: int, kind: str) -> None:
        data = payload(size, seed=size)
        tier.put(KEY, source(kind, data))
        assert tier.get(KEY) == data
        assert tier.size(KEY) == size
        assert tier.exists(KEY) is True
        out = page_aligned(size)
        assert tier.read_into(KEY, out) == size
        assert bytes(out) == data

    def test_put_with_name_sync_deferred(self, tier: Tier) -> None:
        keys = [f"chunks/{i:02x}/{i:02x}ee" for i in range(3)]
        for i, key in enumerate(keys):
            tier.put(key, payload(5000 + i, seed=i), sync_name=False)
        tier.sync_names(keys)
        assert [tier.get(k) for k in keys] == [payload(5000 + i, seed=i) for i in range(3)]
        assert tier.list("chunks/") == keys

    def test_overwrite(self, tier: Tier) -> None:
        big, small = payload(MIB + 5, seed=1), payload(100, seed=2)
        tier.put(KEY, big)
        tier.put(KEY, small)
        assert tier.get(KEY) == small
        assert tier.size(KEY) == 100
        tier.put(KEY, big)
        assert tier.get(KEY) == big
        assert tier.list() == [KEY]

    @pytest.mark.parametrize(
        ("offset", "length", "shift", "expected"),
        [
            (0, 3 * MIB + 17, 0, 3 * MIB + 17),
            (4096, MIB, 0, MIB),
            (1, 10_000, 0, 10_000),
            (4096, 8192, 3, 8192),
            (12_345, MIB + 1, 7, MIB + 1),
            (3 * MIB + 17 - 100, 8192, 0, 100),
            (3 * MIB - 4096, 8192, 0, 4113),
            (3 * MIB + 17, 10, 0, 0),
        ],
    )
    def test_read_into(self, tier: Tier, offset: int, length: int, shift: int, expected: int) -> None:
        data = payload(3 * MIB + 17, seed=3)
        tier.put(KEY, data)
        out = page_aligned(length, shift=shift)
        out[:] = b"\xab" * length
        seen: list[bytes] = []
        assert tier.read_into(KEY, out, offset, observe=lambda piece: seen.append(bytes(piece))) == expected
        assert bytes(out[:expected]) == data[offset : offset + expected]
        assert bytes(out[expected:]) == b"\xab" * (length - expected)
        # The observer saw exactly the bytes read, in order (a restore hashes them this way).
        assert b"".join(seen) == data[offset : offset + expected]

    def test_misses_return_none(self, tier: Tier) -> None:
        out = page_aligned(16)
        assert tier.get(KEY) is None
        assert tier.size(KEY) is None
        assert tier.exists(KEY) is False
        assert tier.read_into(KEY, out) is None
        assert tier.read_ref("refs/branch/main") is None
        assert tier.list() == []

    def test_delete_is_idempotent(self, tier: Tier) -> None:
        other = "versions/v1.json"
        tier.put(KEY, b"chunk")
        tier.put(other, b"{}")
        tier.delete(KEY)
        assert tier.get(KEY) is None
        assert tier.size(KEY) is None
        tier.delete(KEY)
        tier.delete("chunks/zz/never-written")
        assert tier.list() == [other]
        assert tier.get(other) == b"{}"

    def test_list_by_prefix(self, tier: Tier) -> None:
        keys = [
            "chunks/ab/ab01",
            "chunks/ab/ab02",
            "chunks/cd/cd01",
            "versions/v1.json",
            "versions/v10.json",
            "versions/v2.json",
        ]
        for i, key in enumerate(random.Random(5).sample(keys, len(keys))):
            tier.put(key, payload(i * 3000, seed=i))
        tier.write_ref("refs/branch/main", b"v2", expect=None)
        tier.write_ref("refs/tag/best", b"v1", expect=None)
        assert tier.list() == sorted([*keys, "refs/branch/main", "refs/tag/best"])
        assert tier.list("") == tier.list()
        assert tier.list("chunks/") == keys[:3]
        assert tier.list("chunks/ab/") == keys[:2]
        assert tier.list("chunks/a") == keys[:2]
        assert tier.list("versions/v1") == ["versions/v1.json", "versions/v10.json"]
        assert tier.list("refs/") == ["refs/branch/main", "refs/tag/best"]
        assert tier.list("refs/tag/") == ["refs/tag/best"]
        assert tier.list("nothing/") == []
        assert tier.list("chunks/zz/") == []

    def test_used_bytes_grows_and_shrinks(self, tier: Tier) -> None:
        tier.put("versions/v1.json", b"{}")
        before = tier.used_bytes()
        tier.put(KEY, payload(10_000))
        assert tier.used_bytes() >= before + 10_000
        tier.delete(KEY)
        assert tier.used_bytes() == before

    # ------------------------------------------------------------------ refs

    def test_ref_create_and_conflict(self, tier: Tier) -> None:
        token = tier.write_ref("refs/branch/main", b"v1", expect=None)
        assert tier.read_ref("refs/branch/main") == RefValue(b"v1", token)
        with pytest.raises(ConflictError):
            tier.write_ref("refs/branch/main", b"v2", expect=None)
        assert tier.read_ref("refs/branch/main") == RefValue(b"v1", token)

    def test_ref_compare_and_swap(self, tier: Tier) -> None:
        t1 = tier.write_ref("refs/branch/main", b"v1", expect=None)
        t2 = tier.write_ref("refs/branch/main", b"v2", expect=t1)
        assert t2 != t1
        assert tier.read_ref("refs/branch/main") == RefValue(b"v2", t2)
        with pytest.raises(ConflictError):
            tier.write_ref("refs/branch/main", b"v3", expect=t1)
        assert tier.read_ref("refs/branch/main") == RefValue(b"v2", t2)
        t3 = tier.write_ref("refs/branch/main", b"v3", expect=t2)
        assert tier.read_ref("refs/branch/main") == RefValue(b"v3", t3)

    def test_ref_swap_of_missing_ref_conflicts(self, tier: Tier) -> None:
        with pytest.raises(ConflictError):
            tier.write_ref("refs/branch/main", b"v1", expect="no-such-token")
        assert tier.read_ref("refs/branch/main") is None
        assert tier.list() == []

    def test_ref_delete(self, tier: Tier) -> None:
        t1 = tier.write_ref("refs/tag/t", b"v1", expect=None)
        t2 = tier.write_ref("refs/tag/t", b"v2", expect=t1)
        with pytest.raises(ConflictError):
            tier.delete_ref("refs/tag/t", expect=t1)
        assert tier.read_ref("refs/tag/t") == RefValue(b"v2", t2)
        tier.delete_ref("refs/tag/t", expect=t2)
        assert tier.read_ref("refs/tag/t") is None
        assert tier.list("refs/") == []
        with pytest.raises(ConflictError):
            tier.delete_ref("refs/tag/t", expect=t2)
        t3 = tier.write_ref("refs/tag/t", b"v3", expect=None)
        assert tier.read_ref("refs/tag/t") == RefValue(b"v3", t3)

    # ------------------------------------------------------------------ validation

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_key_raises_and_touches_nothing(self, tier: Tier, key: str) -> None:
        tier.put("versions/v1.json", b"{}")
        tier.write_ref("refs/branch/main", b"v1", expect=None)
        before = self.backing_state(tier)
        calls: list[Callable[[], object]] = [
            lambda: tier.put(key, b"data"),
            lambda: tier.get(key),
            lambda: tier.size(key),
            lambda: tier.exists(key),
            lambda: tier.read_into(key, page_aligned(8)),
            lambda: tier.delete(key),
            lambda: tier.read_ref(key),
            lambda: tier.write_ref(key, b"v", expect=None),
            lambda: tier.delete_ref(key, expect="x"),
        ]
        for call in calls:
            with pytest.raises(InvalidNameError):
                call()
        assert self.backing_state(tier) == before
        assert tier.get("versions/v1.json") == b"{}"

    # ------------------------------------------------------------------ concurrency

    def test_concurrent_puts_of_different_keys(self, tier: Tier) -> None:
        def work(i: int) -> None:
            for j in range(4):
                tier.put(f"chunks/{i:02x}/{i:02x}{j:02x}", payload(i * 70_001 + j, seed=i * 4 + j))

        run_threads(work, 8)
        expected = {f"chunks/{i:02x}/{i:02x}{j:02x}": payload(i * 70_001 + j, seed=i * 4 + j)
                    for i in range(8) for j in range(4)}
        assert tier.list() == sorted(expected)
        for key, data in expected.items():
            assert tier.get(key) == data

    def test_concurrent_puts_of_one_key_are_atomic(self, tier: Tier) -> None:
        versions = [bytes([i]) * (256 * 1024 + 3) for i in range(1, 7)]
        seen: list[bytes | None] = []

        def work(i: int) -> None:
            if i == len(versions):
                for _ in range(20):
                    seen.append(tier.get(KEY))
                return
            for _ in range(3):
                tier.put(KEY, versions[i])

        run_threads(work, len(versions) + 1)
        assert tier.get(KEY) in versions
        assert all(s is None or s in versions for s in seen)
        assert tier.list() == [KEY]

    def test_concurrent_compare_and_swap_never_loses_an_update(self, tier: Tier) -> None:
        key = "refs/branch/counter"
        tier.write_ref(key, b"0", expect=None)

        def work(_: int) -> int:
            conflicts = 0
            for _ in range(10):
                while True:
                    current = tier.read_ref(key)
                    assert current is not None
                    try:
                        tier.write_ref(key, b"%d" % (int(current.data) + 1), expect=current.token)
                        break
                    except ConflictError:
                        conflicts += 1
            return conflicts

        run_threads(work, 4)
        current = tier.read_ref(key)
        assert current is not None
        assert current.data == b"40"
