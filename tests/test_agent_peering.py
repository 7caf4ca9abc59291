"""The agents' peer-copy transport (tiercache.agent.peering) between two ports in one process.

Two caches stand for two nodes' disks; real sockets on loopback, real chunk files. The
multi-process cases (agents that fail or die sending, the whole group) are in tests/test_agent.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.agent.peering import PeerPort, advertised_host
from tiercache.agent.peerwire import ACK, CHUNK, HELLO, Frame, PeerKey
from tiercache.cache import core_of
from tiercache.errors import IntegrityError, TierUnavailableError
from tiercache.group.copies import PeerFiles
from tiercache.group.transfer import Move, Slot, schedule
from tiercache.names import chunk_key
from tiercache.restore import byte_view

HOST = "127.0.0.1"
KEY = PeerKey(bytes(range(32)))  # the job's key (the coordinator draws one per job)


def _token(name: str) -> bytes:
    return name.encode().ljust(16, b"\0")


def _hello(endpoint: tuple[str, int], token: bytes, src: int, key: PeerKey = KEY) -> socket.socket:
    """A connection that said hello as rank ``src`` of version ``token`` and was answered.

    As a sending agent does, it tries again while the port closes it unanswered: the port learns
    the job's key when one of its ranks hands it its moves.
    """
    deadline = time.monotonic() + 20
    while True:
        s = socket.create_connection(endpoint, timeout=20)
        s.sendall(key.seal(Frame(HELLO, token, src)))
        try:
            if s.recv(1) == ACK:
                return s
        except ConnectionResetError:
            pass
        s.close()
        assert time.monotonic() < deadline, "the port never took the job's key"
        time.sleep(0.02)


def _closed_unanswered(s: socket.socket) -> bool:
    """Whether the port closed ``s`` without a byte (reset, if it left what ``s`` sent unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Any, Any, str]]:
    """Node 0's cache holding a version on its disk, node 1's empty one, and the version's id."""
    cfg = {"chunk_bytes": "64KiB", "pack_below": "4KiB"}
    a = tiercache.open({**cfg, "disk": {"path": str(tmp_path / "a")}})
    b = tiercache.open({**cfg, "disk": {"path": str(tmp_path / "b")}})
    state = {"w": torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)), "step": 1}
    vid = a.save(state, step=1).wait("durable")
    try:
        yield a, b, vid
    finally:
        a.close()
        b.close()


@pytest.fixture
def ports() -> Iterator[tuple[PeerPort, PeerPort]]:
    pa, pb = PeerPort(), PeerPort()
    yield pa, pb
    pa.close()
    pb.close()


def _slots(cache: Any, vid: str) -> list[Slot]:
    chunks = sorted({(c.id, c.nbytes) for c in cache.manifest(vid).chunks})
    return schedule([Move(cid, n, 0, (1,)) for cid, n in chunks], 1 << 20)


def _both(pa: PeerPort, pb: PeerPort, send: PeerFiles, land: PeerFiles, slots: list[Slot],
          token: bytes = _token("t1"), timeout: float = 20.0) -> list[BaseException | None]:
    """Rank 0 (port a) sends, rank 1 (port b) receives; each side's error (or None)."""
    endpoints = {0: pa.endpoint(HOST), 1: pb.endpoint(HOST)}
    errors: list[BaseException | None] = [None, None]

    def side(i: int, port: PeerPort, files: PeerFiles) -> None:
        try:
            port.copy(token=token, key=KEY, rank=i, slots=slots, endpoints=endpoints, files=files, timeout=timeout,
                      threads=2)
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=side, args=(0, pa, send)), threading.Thread(target=side, args=(1, pb, land))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return errors


def test_the_chunks_land_verified_on_the_other_nodes_disk(nodes: Any, ports: Any) -> None:
    a, b, vid = nodes
    slots = _slots(a, vid)
    assert len(slots) > 1
    errors = _both(*ports, PeerFiles(core_of(a), "disk", vid), PeerFiles(core_of(b), "disk", vid), slots)
    assert errors == [None, None]
    for s in slots:  # node 1 reads each from its own disk (verified against its id), the bytes of node 0's
        got, want = (torch.empty(s.move.nbytes, dtype=torch.uint8) for _ in range(2))
        for cache, buf in ((a, want), (b, got)):
            n = s.move.nbytes
            core_of(cache).reader.read_chunk(s.move.chunk, n, cache.config.hash, [(byte_view(buf), 0, n)])
        assert torch.equal(got, want)
    assert all(core_of(b).repo.durable["disk"].get(chunk_key(s.move.chunk)) is not None for s in slots)
    sent = sum(s.move.nbytes for s in slots)
    assert ports[0].bytes["sent"] == ports[1].bytes["received"] == sent


class _Flipping(PeerFiles):
    """A sender whose bytes get damaged on the way (a bad NIC, a bug): one bit of every chunk flipped."""

    def read(self, m: Move) -> torch.Tensor:
        data = super().read(m)
        data[0] ^= 1
        return data


class _Failing(PeerFiles):
    def read(self, m: Move) -> torch.Tensor:
        raise IntegrityError(f"{m.chunk} is damaged on this node's tiers")


@pytest.mark.parametrize(("sender", "want"), [
    (_Flipping, "from rank 0 does not match its id"),  # bad input: checked against its id, never written
    (_Failing, "rank 0 could not read"),  # the sender tells the receiver at once
])
def test_a_chunk_that_is_damaged_or_unreadable_fails_the_receiver_and_lands_nowhere(
    nodes: Any, ports: Any, sender: Callable[..., PeerFiles], want: str
) -> None:
    a, b, vid = nodes
    slots = _slots(a, vid)
    errors = _both(*ports, sender(core_of(a), "disk", vid), PeerFiles(core_of(b), "disk", vid), slots)
    assert isinstance(errors[1], IntegrityError) and want in str(errors[1]), errors
    if sender is _Failing:
        assert isinstance(errors[0], IntegrityError)
    for s in slots:
        assert core_of(b).repo.durable["disk"].get(chunk_key(s.move.chunk)) is None


def test_a_sender_that_goes_away_fails_the_receiver_at_once_and_strangers_land_nothing(
    nodes: Any, ports: Any
) -> None:
    a, b, vid = nodes
    _, pb = ports
    slots = _slots(a, vid)
    host, port = pb.endpoint(HOST)
    result: list[BaseException | None] = []

    def receive() -> None:
        try:
            pb.copy(token=_token("t2"), key=KEY, rank=1, slots=slots, endpoints={0: ("127.0.0.1", 9)},
                    files=PeerFiles(core_of(b), "disk", vid), timeout=60.0, threads=1)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=receive)
    t.start()

    # A stranger (another job's key) sends a "chunk" of the version: closed unanswered, nothing written.
    m = slots[0].move
    other = PeerKey(b"\1" * 32)
    with socket.create_connection((host, port)) as s:
        s.sendall(other.seal(Frame(HELLO, _token("t2"), 0)))
        s.sendall(other.seal(Frame(CHUNK, _token("t2"), 0, 1, slots[0].tag, 4, 0.0, 1)) + b"junk")
        assert _closed_unanswered(s)
    # Rank 0's agent connects, sends nothing, and dies: the receiver fails now, not after 60 s.
    _hello((host, port), _token("t2"), 0).close()
    t.join(20)
    assert not t.is_alive()
    [err] = result
    assert isinstance(err, TierUnavailableError) and "rank 0's node agent stopped before it sent" in str(err), err
    assert core_of(b).repo.durable["disk"].get(chunk_key(m.chunk)) is None


def test_a_receiver_that_asks_after_its_sender_left_fails_at_once(nodes: Any, ports: Any) -> None:
    """The sending agent connected and died before the receiving rank handed its moves over."""
    a, b, vid = nodes
    _, pb = ports
    slots = _slots(a, vid)
    host, port = pb.endpoint(HOST)
    pb.learn(KEY)  # from the rank that asked for its endpoint
    _hello((host, port), _token("t3"), 0).close()
    time.sleep(0.5)  # the receiving agent saw the connection close
    # (Not DeadlineExceededError after the 60 s timeout: the receiver knows its sender is gone.)
    with pytest.raises(TierUnavailableError, match="rank 0's node agent stopped before it sent"):
        pb.copy(token=_token("t3"), key=KEY, rank=1, slots=slots, endpoints={0: ("127.0.0.1", 9)},
                files=PeerFiles(core_of(b), "disk", vid), timeout=60.0, threads=1)


def test_the_advertised_host_is_the_route_to_the_store() -> None:
    class Store:
        host = "127.0.0.1"

    class Prefix:
        underlying_store = Store()

    assert advertised_host(Prefix()) == "127.0.0.1"  # type: ignore[arg-type]


def test_a_frame_of_the_wrong_size_fails_its_move_and_no_header_makes_the_agent_allocate_what_it_claims(
    nodes: Any, ports: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, vid = nodes
    _, pb = ports
    slots = _slots(a, vid)
    host, port = pb.endpoint(HOST)
    crashed: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    result: list[BaseException | None] = []

    def receive() -> None:
        try:
            pb.copy(token=_token("t4"), key=KEY, rank=1, slots=slots[:1], endpoints={0: ("127.0.0.1", 9)},
                    files=PeerFiles(core_of(b), "disk", vid), timeout=60.0, threads=1)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=receive)
    t.start()
    m, tag = slots[0].move, slots[0].tag

    with _hello((host, port), _token("other"), 5) as s:
        # A header of another version claiming a terabyte: the agent drains what comes, never allocates it.
        s.sendall(KEY.seal(Frame(CHUNK, _token("other"), 5, 1, 0, 1 << 40, 0.0, 1)) + b"x" * 100)
    with _hello((host, port), _token("t4"), 0) as s:
        # The move's frame with 3 bytes more than the chunk: the move fails at once, naming the sizes.
        s.sendall(KEY.seal(Frame(CHUNK, _token("t4"), 0, 1, tag, m.nbytes + 3, 5.0, 1)) + b"\0" * (m.nbytes + 3))
        t.join(20)
    assert not t.is_alive()
    [err] = result
    assert isinstance(err, IntegrityError) and str(err) == (
        f"rank 0 sent {m.nbytes + 3} bytes for {m.chunk}, not its {m.nbytes}"), err
    assert core_of(b).repo.durable["disk"].get(chunk_key(m.chunk)) is None
    assert crashed == []

