"""The node agent's parts on their own: wire protocol, shared arena, sweep, environment checks, GPU pinning.

Real sockets (``socketpair``), real files in ``/dev/shm`` and real ``flock`` locks held by real
processes; a real 8 MiB tmpfs where the arena must not fit. A cgroup memory limit cannot be set
here without changing the machine's own cgroup tree, so the limit checks read a tree laid out
like cgroupfs (v1 and v2) in a temporary directory, and this machine's real one.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _agent import shm_place

import tiercache
from tiercache import errors
from tiercache.agent import naming
from tiercache.agent.arena import SharedArena, map_shared, sweep
from tiercache.agent.lifecycle import cgroup_memory_limit, check_environment
from tiercache.agent.protocol import Connection, ProtocolError, error_from_wire, error_to_wire
from tiercache.agent.saver import pin_mapping
from tiercache.cache import core_of
from tiercache.config import load_config
from tiercache.format import flatten
from tiercache.layout import plan_layout
from tiercache.pipeline.engine import Engine
from tiercache.pipeline.job import StagedVersion
from tiercache.tiers.ram import map_in


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Connection(a), Connection(b)
    yield ca, cb
    ca.close()
    cb.close()


@pytest.fixture
def shm() -> Iterator[Path]:
    with shm_place("tcp") as d:
        yield d


@pytest.fixture
def tmpfs8(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs."""
    d = tmp_path / "small"
    d.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.decode().strip()}): needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


# ------------------------------------------------------------------------ the wire


def test_frames_cross_whole_whatever_the_reads(pair: tuple[Connection, Connection]) -> None:
    a, b = pair
    big = {"op": "x", "id": 1, "blob": "ab" * (3 << 20)}  # spans many reads
    sender = threading.Thread(target=lambda: (a.send(big), a.send({"op": "y", "id": 2})))
    sender.start()
    assert b.recv() == (big, [])
    sender.join()
    assert b.recv() == ({"op": "y", "id": 2}, [])
    a.close()
    assert b.recv() is None


def test_a_descriptor_travels_with_its_frame(pair: tuple[Connection, Connection], tmp_path: Path) -> None:
    a, b = pair
    f = tmp_path / "f"
    f.write_bytes(b"node memory")
    fd = os.open(f, os.O_RDONLY)
    try:
        a.send({"id": 1, "arena": {"size": 11}}, [fd])
    finally:
        os.close(fd)
    msg, fds = b.recv()  # type: ignore[misc]
    assert msg == {"id": 1, "arena": {"size": 11}} and len(fds) == 1
    assert os.read(fds[0], 100) == b"node memory"
    os.close(fds[0])


def test_malformed_frames_are_refused(pair: tuple[Connection, Connection]) -> None:
    a, b = pair
    a.sock.sendall(struct.pack("<I", 5) + b"nope!")
    with pytest.raises(ProtocolError, match="malformed message"):
        b.recv()
    a.sock.sendall(struct.pack("<I", 2) + b"[]")
    with pytest.raises(ProtocolError, match="JSON object"):
        b.recv()
    a.sock.sendall(struct.pack("<I", 1 << 31))
    with pytest.raises(ProtocolError, match="larger than"):
        b.recv()


def test_errors_cross_as_their_own_class() -> None:
    full = error_from_wire(error_to_wire(errors.TierFullError("no room")))
    assert type(full) is errors.TierFullError and str(full) == "no room"
    # A class that needs keyword attributes arrives as the root class, message kept.
    ref = error_from_wire(error_to_wire(errors.RefExistsError("tag x exists", kind="tag", name="x", version="v")))
    assert type(ref) is errors.TierCacheError and "tag x exists" in str(ref)
    other = error_from_wire(error_to_wire(KeyError("k")))
    assert type(other) is errors.TierCacheError and str(other) == "KeyError: 'k'"


def test_the_agent_and_the_group_rebuild_a_remote_error_alike() -> None:
    from tiercache.group.phase_status import Status

    for err in (errors.TierFullError("no room"), errors.GroupSaveError("rank 1 failed"),
                errors.RefExistsError("tag x exists", kind="tag", name="x", version="v"), KeyError("k")):
        agent = error_from_wire(error_to_wire(err))
        group = Status.decode(Status.of(err).encode()).error_object()
        assert str(agent) == str(group)
        # What this tiercache has no class for arrives as each side's root: any error over the socket,
        # a failed version in a group.
        roots = (errors.TierCacheError, errors.GroupSaveError)
        assert type(agent) is type(group) or (type(agent), type(group)) == roots
    assert str(error_from_wire(error_to_wire(KeyError("k")))) == "KeyError: 'k'"


# ------------------------------------------------------------------------ the arena


def test_the_arena_is_private_locked_and_only_its_agent_unlinks_it(shm: Path) -> None:
    path = shm / "tiercache-0-k-b.arena"
    arena = SharedArena(path, 1 << 20)
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_size == 1 << 20
    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by its agent
    os.close(fd)
    # A trainer's mapping: another file description, so it never holds the agent's lock.
    mapping = map_shared(os.dup(arena.fd), 1 << 20)
    arena.mapping[100:105] = b"hello"
    assert mapping[100:105] == b"hello"
    with pytest.raises(errors.ConfigError, match="belongs to a running agent"):
        SharedArena(path, 1 << 20)
    arena.mapping.close()  # as if the agent died: its lock goes with it, the trainer's mapping stays
    os.close(arena.fd)
    assert sweep(shm) == [path]
    assert mapping[100:105] == b"hello"
    mapping.close()


def _resident_kib(mapping: mmap.mmap) -> int:
    """This process's resident KiB of ``mapping`` (its page tables), from /proc/self/smaps."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    lines = Path("/proc/self/smaps").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.split("-")[0] == f"{start:x}")
    return int(next(line for line in lines[head:] if line.startswith("Rss:")).split()[1])


class _OldKernelMapping(mmap.mmap):
    """A mapping whose kernel refuses MADV_POPULATE_READ (before Linux 5.14)."""

    def madvise(self, *args: int) -> None:
        raise OSError(22, "Invalid argument")


@pytest.mark.parametrize("kind", [mmap.mmap, _OldKernelMapping], ids=["populate-read", "old-kernel"])
def test_a_trainer_maps_the_arena_in_without_writing_it(shm: Path, kind: type[mmap.mmap]) -> None:
    size = 4 << 20
    arena = SharedArena(shm / "tiercache-0-k-b.arena", size)
    arena.prefault()
    arena.mapping[: size] = bytes(range(256)) * (size // 256)
    fd = os.open(arena.path, os.O_RDWR)
    mapping = kind(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    assert _resident_kib(mapping) == 0
    map_in(mapping)
    assert _resident_kib(mapping) == size // 1024  # every page is in this process's page tables
    assert mapping[:] == arena.mapping[:]  # and nothing was written
    mapping[4096:4101] = b"saved"  # the pages take writes, which the agent sees
    assert arena.mapping[4096:4101] == b"saved"
    mapping.close()
    arena.mapping.close()
    arena.close()


def test_an_arena_that_does_not_fit_is_one_clear_error(tmpfs8: Path) -> None:
    with pytest.raises(errors.TierFullError) as e:
        SharedArena(tmpfs8 / "tiercache-0-k-b.arena", 32 << 20)
    msg = str(e.value)
    assert "has 8 MiB free but [ram] capacity needs 32 MiB" in msg and "--shm-size=" in msg
    assert "emptyDir" in msg and "\n" not in msg
    assert list(tmpfs8.iterdir()) == []  # nothing left behind


def test_sweep_removes_dead_agents_and_other_boots_arenas_only(shm: Path) -> None:
    uid, boot = os.getuid(), naming.boot_id()
    dead = shm / f"tiercache-{uid}-aaaa-{boot}.arena"
    other_boot = shm / f"tiercache-{uid}-bbbb-00000000.arena"
    live = shm / f"tiercache-{uid}-cccc-{boot}.arena"
    other_user = shm / f"tiercache-{uid + 1}-dddd-00000000.arena"
    unrelated = shm / "something-else"
    for p in (dead, other_boot, live, other_user, unrelated):
        p.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(60)"), str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert sorted(sweep(shm)) == sorted([dead, other_boot])
        assert live.exists() and other_user.exists() and unrelated.exists()
    finally:
        holder.kill()
        holder.wait()
    assert sweep(shm) == [live]  # its holder is gone now


# ------------------------------------------------------------------------ environment checks


def _place(tmp_path: Path, shm_dir: Path) -> naming.AgentPlace:
    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    return naming.AgentPlace(key="k", socket=sock_dir / "a.sock", shm_dir=shm_dir)


def _cfg(tmp_path: Path, capacity: str) -> tiercache.CacheConfig:
    return load_config({"ram": {"capacity": capacity}, "disk": {"path": str(tmp_path / "d")}, "agent": {}})


def test_dev_shm_too_small_for_the_arena_is_one_line(tmp_path: Path, tmpfs8: Path) -> None:
    problems = check_environment(_cfg(tmp_path, "32MiB"), _place(tmp_path, tmpfs8),
                                 proc_cgroup=tmp_path / "none")
    assert len(problems) == 1 and "--shm-size" in problems[0]
    assert check_environment(_cfg(tmp_path, "4MiB"), _place(tmp_path, tmpfs8), proc_cgroup=tmp_path / "none") == []


def _cgroupfs(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_container_memory_limit_smaller_than_the_arena_is_one_line(tmp_path: Path, shm: Path) -> None:
    # cgroup v2: the limit is on the pod, a level above the container's own (which says max).
    v2 = _cgroupfs(tmp_path / "v2", {"cgroup.controllers": "memory", "kubepods/pod1/memory.max": "805306368\n",
                                     "kubepods/pod1/ctr/memory.max": "max\n"})
    proc = tmp_path / "cgroup-v2"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_memory_limit(proc, v2) == (805306368, str(v2 / "kubepods/pod1/memory.max"))
    problems = check_environment(_cfg(tmp_path, "1GiB"), _place(tmp_path, shm), proc_cgroup=proc, cgroup_root=v2)
    assert len(problems) == 1
    assert "memory limit of this container is 768 MiB" in problems[0] and "resources.limits.memory" in problems[0]
    assert check_environment(_cfg(tmp_path, "64MiB"), _place(tmp_path, shm), proc_cgroup=proc, cgroup_root=v2) == []
    # cgroup v1, as Docker sets it (--memory=512m); unlimited reads as a huge number.
    v1 = _cgroupfs(tmp_path / "v1", {"memory/docker/abc/memory.limit_in_bytes": "536870912\n",
                                     "memory/memory.limit_in_bytes": "9223372036854771712\n"})
    proc1 = tmp_path / "cgroup-v1"
    proc1.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory_limit(proc1, v1) == (536870912, str(v1 / "memory/docker/abc/memory.limit_in_bytes"))
    unlimited = _cgroupfs(tmp_path / "v1u", {"memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_memory_limit(proc1, unlimited) is None


def test_this_machines_cgroup_limit_reads_without_error() -> None:
    got = cgroup_memory_limit()
    assert got is None or (got[0] > 0 and Path(got[1]).is_file())


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o755])
def test_a_socket_directory_that_is_not_0700_is_refused(tmp_path: Path, shm: Path, mode: int) -> None:
    place = _place(tmp_path, shm)
    place.socket.parent.chmod(mode)
    problems = check_environment(_cfg(tmp_path, "auto"), place, proc_cgroup=tmp_path / "none")
    assert problems == [f"the agent's directory {place.socket.parent} has mode {mode:04o}, not 0700: remove it, "
                        "or set XDG_RUNTIME_DIR or [agent] socket to a directory of your own (mode 0700)"]
    place.socket.parent.chmod(0o700)
    assert check_environment(_cfg(tmp_path, "auto"), place, proc_cgroup=tmp_path / "none") == []


# ------------------------------------------------------------------------ GPU pinning and the engine


class _CudaRuntime:
    """Stands in for torch.cuda.cudart() on this machine (no GPU): records what it is asked."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.calls: list[tuple[int, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append((address, nbytes, flags))
        return self.answer


def test_the_shared_arena_is_page_locked_whole_once(caplog: pytest.LogCaptureFixture) -> None:
    mapping = bytearray(1 << 16)
    t = torch.frombuffer(mapping, dtype=torch.uint8)
    rt = _CudaRuntime(0)
    assert pin_mapping(t.data_ptr(), t.numel(), rt) is True
    assert rt.calls == [(t.data_ptr(), 1 << 16, 1)]  # cudaHostRegisterPortable, the whole mapping
    refused = _CudaRuntime(2)  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, "tiercache"):
        assert pin_mapping(t.data_ptr(), t.numel(), refused) is False
    assert "cannot page-lock the 65536-byte shared arena (cudaError 2)" in caplog.text


def test_engine_adopt_finishes_a_version_copied_by_someone_else(tmp_path: Path) -> None:
    """The agent's entry point, in process: bytes already in regions of the arena, then the same pipeline."""
    state = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.tensor([1, 2, 3]), "step": 4}
    with tiercache.open({"ram": {"capacity": "8MiB"}, "disk": {"path": str(tmp_path)},
                         "pack_below": "4KiB"}) as cache:
        engine = cache.engine.local
        assert isinstance(engine, Engine)
        flat = flatten(state)
        layout = plan_layout([m.nbytes for m in flat.metas], [4, 1], chunk_bytes=cache.config.chunk_bytes,
                             pack_below=cache.config.pack_below)
        regions = engine.reserve(layout)
        assert regions is not None
        arena = engine.ramcache.arena
        assert arena is not None
        from tiercache.codecs import HEADER_BYTES

        for ti, pieces in enumerate(layout.tensor_pieces):
            src = flat.tensors[ti].reshape(-1).view(torch.uint8)
            for ci, p in pieces:
                dst = arena.tensor(regions[ci])
                dst[HEADER_BYTES + p.chunk_offset: HEADER_BYTES + p.chunk_offset + p.nbytes] = \
                    src[p.offset: p.offset + p.nbytes]
        with core_of(cache).next_version("main") as nxt:
            staged = StagedVersion("01ADOPTEDVERSION0000000000", "main", 4, nxt.seq, nxt.parent, {}, time.time(),
                                   flat.tree, tuple(flat.metas), flat.pickled)
            h = engine.adopt(staged, layout, regions)
            nxt.version = h.version
        assert h.wait("staged") == h.version and h.wait("local") == h.version
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        got = cache.restore("main")
        assert got["step"] == 4
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_kept_parts_pin_their_chunks_until_released_or_taken(tmp_path: Path) -> None:
    """KeptParts on a real engine's RAM tier: kept chunks are pinned; release and take let them go, once each."""
    import tiercache
    from tiercache.agent.keep import KeptParts
    from tiercache.names import chunk_key

    with tiercache.open({"ram": {"capacity": "8MiB"}, "disk": {"path": str(tmp_path / "disk")},
                         "chunk_bytes": "128KiB"}) as cache:
        vid = cache.save({"x": torch.randn(1 << 16)}, step=3).wait("durable")
        manifest = cache.manifest(vid)
        ram = cache.engine.local.ramcache  # type: ignore[attr-defined]
        keys = [chunk_key(c.id) for c in manifest.chunks]
        kept = KeptParts()

        def record(v: str, step: int, branch: str = "main") -> dict[str, object]:
            return {"v": v, "rank": 0, "world": 2, "branch": branch, "step": step, "created_at": 0.0, "meta": {}}

        kept.keep("a.0", record("a", 3), manifest, ram)
        kept.keep("b.0", record("b", 5), manifest, ram)
        kept.keep("c.0", record("c", 4, "ft"), manifest, ram)
        kept.keep("c.0", record("c", 4, "ft"), manifest, ram)  # kept once
        assert [o["v"] for o in kept.offered(0)] == ["a", "b", "c"] and kept.offered(1) == []
        assert ram.evict(keys) == 0  # pinned: nothing goes
        assert kept.release(lambda o: o["branch"] == "main" and o["step"] <= 4, "step 4 committed", ram) == 1
        assert kept.take("b.0", ram) and not kept.take("b.0", ram)
        assert (len(kept), kept.released, "c.0" in kept) == (1, 1, True)
        assert ram.evict(keys) == 0  # "c" still pins them
        kept.release(lambda o: True, "done", ram)
        assert ram.evict(keys) > 0 and (len(kept), kept.released) == (0, 2)
