from __future__ import annotations

import errno
import multiprocessing
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tier_conformance import KEY, MIB, TierConformance, page_aligned, payload

from tiercache.config import DiskConfig
from tiercache.errors import ConflictError, InvalidNameError, StorageError, TierFullError
from tiercache.tiers.base import RefValue
from tiercache.tiers.disk import PIECE_BYTES, READ_PIECE_BYTES, DiskTier


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (dotfiles included) with its mode and size."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_mode, st.st_size if path.is_file() else 0)
    return out


class TestDiskConformance(TierConformance):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[DiskTier]:
        t = DiskTier(DiskConfig(path=tmp_path / "disk"))
        yield t
        t.close()

    def backing_state(self, tier: DiskTier) -> object:  # type: ignore[override]
        return tree(tier.root)


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(DiskConfig(path=tmp_path / "disk"))


def test_permissions_are_private(disk: DiskTier) -> None:
    disk.put(KEY, payload(5000))
    disk.write_ref("refs/branch/main", b"v1", expect=None)
    modes = {rel: stat.S_IMODE(mode) for rel, (mode, _) in tree(disk.root).items()}
    assert stat.S_IMODE(disk.root.stat().st_mode) == 0o700
    assert modes == {
        "chunks": 0o700,
        "chunks/ab": 0o700,
        KEY: 0o600,
        "refs": 0o700,
        "refs/.lock": 0o600,
        "refs/branch": 0o700,
        "refs/branch/main": 0o600,
    }


def test_o_direct_is_used_on_ext4(disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    flags: list[int] = []
    real_open = os.open

    def recording_open(path: str, fl: int, *args: int) -> int:
        fd = real_open(path, fl, *args)
        flags.append(fl)
        return fd

    monkeypatch.setattr(os, "open", recording_open)
    data = payload(2 * MIB + 4096 + 100)
    src = page_aligned(len(data))
    src[:] = data
    disk.put(KEY, src)
    out = page_aligned(2 * MIB)
    assert disk.read_into(KEY, out, 4096) == 2 * MIB
    assert bytes(out) == data[4096 : 4096 + 2 * MIB]
    assert disk.o_direct_active is True
    direct_opens = [fl & os.O_ACCMODE for fl in flags if fl & os.O_DIRECT]
    assert direct_opens == [os.O_WRONLY, os.O_RDONLY]  # the tmp file, then the object


def test_falls_back_when_open_refuses_o_direct(disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refusing_open(path: str, fl: int, *args: int) -> int:
        if fl & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, fl, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    data = payload(MIB + 3)
    disk.put(KEY, data)
    assert disk.o_direct_active is False
    assert disk.get(KEY) == data
    assert disk.list() == [KEY]


def test_falls_back_when_write_refuses_o_direct(disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    real_pwrite = os.pwrite

    def refusing_pwrite(fd: int, buf: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    data = payload(3 * MIB + 11)
    disk.put(KEY, data)
    assert disk.o_direct_active is False
    assert disk.get(KEY) == data


@pytest.mark.parametrize("size", [100, 5 * MIB + 1])
def test_enospc_raises_tier_full_once_and_leaves_nothing(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    disk.put("versions/v1.json", b"{}")
    used = disk.used_bytes()
    before = tree(disk.root)
    attempts: list[int] = []

    def full(fd: int, buf: memoryview, *args: int) -> int:
        attempts.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(TierFullError) as info:
        disk.put("versions/v2.json", payload(size))
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert len(attempts) == 1  # ENOSPC is permanent: never retried
    assert tree(disk.root) == before
    assert disk.list() == ["versions/v1.json"]
    assert disk.used_bytes() == used


def test_other_write_error_is_storage_error_and_leaves_nothing(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk.put(KEY, b"old")
    before = tree(disk.root)

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(StorageError) as info:
        disk.put(KEY, payload(9000))
    assert type(info.value) is StorageError
    assert info.value.__cause__ is not None and info.value.__cause__.errno == errno.EIO
    monkeypatch.undo()
    assert tree(disk.root) == before
    assert disk.get(KEY) == b"old"


def test_capacity_budget(tmp_path: Path) -> None:
    disk = DiskTier(DiskConfig(path=tmp_path / "disk", capacity=10_000))
    disk.put("chunks/aa/a", payload(6000, seed=1))
    with pytest.raises(TierFullError, match=r"disk\.capacity"):
        disk.put("chunks/bb/b", payload(6000, seed=2))
    assert disk.list() == ["chunks/aa/a"]
    assert [p.name for p in disk.root.rglob(".tmp-*")] == []
    disk.put("chunks/aa/a", payload(9000, seed=3))  # an overwrite only needs the difference
    assert disk.used_bytes() == 9000
    disk.delete("chunks/aa/a")
    disk.put("chunks/bb/b", payload(6000, seed=2))
    assert disk.used_bytes() == 6000
    assert disk.get("chunks/bb/b") == payload(6000, seed=2)


def test_used_bytes_scans_existing_data(disk: DiskTier, tmp_path: Path) -> None:
    disk.put("chunks/aa/a", payload(1234))
    disk.put("versions/v.json", payload(77))
    disk.write_ref("refs/branch/main", b"v", expect=None)
    reopened = DiskTier(DiskConfig(path=tmp_path / "disk"))
    assert reopened.used_bytes() == disk.used_bytes()
    assert reopened.used_bytes() == 1234 + 77 + (tmp_path / "disk/refs/branch/main").stat().st_size


def test_second_tier_on_same_directory_sees_everything(disk: DiskTier, tmp_path: Path) -> None:
    data = payload(MIB + 9)
    disk.put(KEY, data)
    token = disk.write_ref("refs/branch/main", b"v1", expect=None)
    other = DiskTier(DiskConfig(path=tmp_path / "disk"))
    assert other.list() == [KEY, "refs/branch/main"]
    assert other.get(KEY) == data
    assert other.read_ref("refs/branch/main") == RefValue(b"v1", token)
    t2 = other.write_ref("refs/branch/main", b"v2", expect=token)
    with pytest.raises(ConflictError):
        disk.write_ref("refs/branch/main", b"v3", expect=token)
    assert disk.read_ref("refs/branch/main") == RefValue(b"v2", t2)


def test_rewriting_identical_bytes_changes_the_token(disk: DiskTier) -> None:
    t1 = disk.write_ref("refs/branch/main", b"v1", expect=None)
    t2 = disk.write_ref("refs/branch/main", b"v1", expect=t1)
    assert t2 != t1
    with pytest.raises(ConflictError):
        disk.write_ref("refs/branch/main", b"v9", expect=t1)
    assert disk.read_ref("refs/branch/main") == RefValue(b"v1", t2)


def _increment(root: str, n: int) -> None:
    tier = DiskTier(DiskConfig(path=Path(root)))
    for _ in range(n):
        while True:
            current = tier.read_ref("refs/branch/counter")
            assert current is not None
            try:
                tier.write_ref("refs/branch/counter", b"%d" % (int(current.data) + 1), expect=current.token)
                break
            except ConflictError:
                continue


def test_compare_and_swap_across_processes_never_loses_an_update(disk: DiskTier) -> None:
    disk.write_ref("refs/branch/counter", b"0", expect=None)
    # fork: the children only do file I/O, and spawning would re-import torch in each of them.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_increment, args=(str(disk.root), 25)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    current = disk.read_ref("refs/branch/counter")
    assert current is not None and current.data == b"75"


def test_stale_tmp_files_are_hidden_and_swept(disk: DiskTier) -> None:
    disk.put(KEY, b"chunk")
    old = disk.root / "chunks/ab/.tmp-deadbeef"
    fresh = disk.root / "chunks/ab/.tmp-cafef00d"
    old.write_bytes(b"garbage")
    fresh.write_bytes(b"in flight")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert disk.list() == [KEY]
    assert disk.list("chunks/ab/") == [KEY]
    assert disk.sweep_tmp(older_than_s=600) == 1
    assert not old.exists()
    assert fresh.read_bytes() == b"in flight"
    assert disk.get(KEY) == b"chunk"


def test_symlink_escaping_the_root_is_refused(disk: DiskTier, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    disk.root.mkdir()  # (the first write makes the root; here something is planted in it first)
    (disk.root / "chunks").symlink_to(outside)
    with pytest.raises(InvalidNameError):
        disk.put("chunks/x", b"data")
    with pytest.raises(InvalidNameError):
        disk.get("chunks/x")
    assert list(outside.iterdir()) == []


def test_key_naming_a_directory_is_a_miss(disk: DiskTier) -> None:
    disk.put(KEY, b"chunk")
    assert disk.get("chunks/ab") is None
    assert disk.size("chunks") is None
    assert disk.read_into("chunks", page_aligned(8)) is None
    disk.delete("chunks")
    assert disk.get(KEY) == b"chunk"


def test_parallel_aligned_reads_are_exact(disk: DiskTier) -> None:
    from concurrent.futures import ThreadPoolExecutor

    data = payload(16 * MIB + 4096, seed=9)
    disk.put(KEY, data)
    out = page_aligned(len(data))
    piece = 4 * MIB

    def read(i: int) -> int | None:
        return disk.read_into(KEY, out[i * piece : (i + 1) * piece + (4096 if i == 3 else 0)], i * piece)

    with ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(read, range(4)))
    assert counts == [piece, piece, piece, piece + 4096]
    assert bytes(out) == data


@pytest.mark.parametrize(
    ("o_direct", "shift", "largest"),
    [(True, 0, PIECE_BYTES), (True, 64, READ_PIECE_BYTES), (False, 64, None)],
    ids=["direct-into-aligned", "direct-through-bounce", "buffered"],
)
def test_observer_sees_every_piece_in_order(tmp_path: Path, o_direct: bool, shift: int, largest: int | None) -> None:
    disk = DiskTier(DiskConfig(path=tmp_path / "disk", o_direct=o_direct))
    data = payload(4096 + 2 * PIECE_BYTES + 12_345, seed=11)
    disk.put(KEY, data)
    out = page_aligned(len(data) - 4096, shift=shift)
    seen: list[bytes] = []
    assert disk.read_into(KEY, out, 4096, observe=lambda piece: seen.append(bytes(piece))) == len(out)
    assert bytes(out) == data[4096:]
    assert b"".join(seen) == data[4096:]
    if largest is not None:
        # Reads move in pieces: a whole-file read would hash the tensor from memory afterwards.
        assert len(seen) > 1 and max(map(len, seen)) == largest


@pytest.mark.parametrize("tail", [0, 123])
def test_a_pending_put_is_named_at_commit_and_written_in_any_order(tmp_path: Path, tail: int) -> None:
    disk = DiskTier(DiskConfig(path=tmp_path / "disk", capacity=1 << 20))
    data = payload(4096 + 64 * 1024 + tail, seed=7)
    src = page_aligned(len(data))
    src[:] = data
    pending = disk.begin_put(len(data), "chunks")
    pending.write(4096, src[4096:])  # the payload first, as the engine does before the hash is known
    assert disk.used_bytes() == 0 and disk._reserved == len(data)
    assert [p.parent.name for p in disk.root.rglob(".tmp-*")] == ["chunks"]
    pending.write(0, src[:4096])
    pending.commit("chunks/ab/abcdef")
    pending.abort()  # a no-op once committed
    assert disk.get("chunks/ab/abcdef") == data
    assert disk.used_bytes() == len(data) and disk._reserved == 0
    assert list(disk.root.rglob(".tmp-*")) == []


def test_an_aborted_pending_put_leaves_nothing_and_gives_its_room_back(tmp_path: Path) -> None:
    disk = DiskTier(DiskConfig(path=tmp_path / "disk", capacity=10_000))
    pending = disk.begin_put(6000, "chunks")
    pending.write(0, payload(6000))
    with pytest.raises(TierFullError, match=r"disk\.capacity"):
        disk.begin_put(6000, "chunks")  # the first one's room is reserved
    pending.abort()
    assert list(disk.root.rglob(".tmp-*")) == [] and disk._reserved == 0
    disk.put("chunks/bb/b", payload(6000, seed=2))
    assert disk.list() == ["chunks/bb/b"]


def test_puts_without_dir_sync_leave_every_directory_to_one_sync_names(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiercache.tiers.disk as diskmod

    disk.root.mkdir()  # as a first write makes it (syncing its parent): here only directories below count
    synced: list[str] = []
    real = diskmod._fsync_dir
    monkeypatch.setattr(diskmod, "_fsync_dir", lambda p: (synced.append(os.path.relpath(p, disk.root)), real(p)))
    keys = ["chunks/aa/a1", "chunks/aa/a2", "chunks/bb/b1"]
    for k in keys[:2]:
        disk.put(k, payload(5000), sync_name=False)  # new directories, created without fsyncs
    pending = disk.begin_put(5000, "chunks", sync_name=False)
    pending.write(0, payload(5000))
    pending.commit(keys[2])
    assert synced == []
    disk.sync_names(keys)
    assert synced == ["chunks/aa", "chunks/bb", "chunks", "."]  # deepest first, each once
    disk.put("versions/v1", b"{}")  # the default syncs at once: the new directory's parent, then itself
    assert synced[4:] == [".", "versions"]
    assert disk.list() == [*keys, "versions/v1"]
