"""The peer port under a stranger's fire: floods, junk, forged and slow frames, absurd numbers.

In process (tests/test_agent_peering.py's two caches and ports, its timeouts shortened): each
case ends with a real peer copy between the two ports, checked bit-exact. The same against a
real agent process, with its trainers, is in tests/test_agent_flood.py.
"""

from __future__ import annotations

import json
import math
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_agent_peering import HOST, KEY, _both, _closed_unanswered, _hello, _slots, _token, nodes

from tiercache.agent import peering
from tiercache.agent.peering import PeerPort, copy_request, port_request
from tiercache.agent.peerwire import CHUNK, HEADER_BYTES, HELLO, UNREADABLE, Frame, PeerKey
from tiercache.cache import core_of
from tiercache.group.copies import PeerFiles
from tiercache.names import chunk_key
from tiercache.restore import byte_view

__all__ = ["nodes"]  # the fixture, shared with tests/test_agent_peering.py


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PeerPort, PeerPort]]:
    """Two ports with a cap of 16 connections and timeouts of a fraction of a second."""
    monkeypatch.setattr(peering, "MAX_CONNECTIONS", 16)
    monkeypatch.setattr(peering, "HELLO_S", 0.5)
    monkeypatch.setattr(peering, "STALL_S", 0.5)
    monkeypatch.setattr(peering, "IDLE_S", 2.0)
    pa, pb = PeerPort(), PeerPort()
    yield pa, pb
    pa.close()
    pb.close()


def _copy_is_whole(a: Any, b: Any, vid: str, pa: PeerPort, pb: PeerPort, token: str) -> None:
    """A real copy from port a to port b lands every chunk, bit-exact."""
    slots = _slots(a, vid)
    before = pb.bytes["received"]
    errors = _both(pa, pb, PeerFiles(core_of(a), "disk", vid), PeerFiles(core_of(b), "disk", vid), slots,
                   token=_token(token))
    assert errors == [None, None]
    for s in slots:
        got, want = (torch.empty(s.move.nbytes, dtype=torch.uint8) for _ in range(2))
        for cache, buf in ((a, want), (b, got)):
            n = s.move.nbytes
            core_of(cache).reader.read_chunk(s.move.chunk, n, cache.config.hash, [(byte_view(buf), 0, n)])
        assert torch.equal(got, want)
    assert pb.bytes["received"] - before == sum(s.move.nbytes for s in slots)


def _gone(s: socket.socket, within: float = 10.0) -> bool:
    """Whether the port closed ``s`` (within ``within`` seconds)."""
    s.settimeout(within)
    try:
        return _closed_unanswered(s)
    except (TimeoutError, OSError):
        return False


def test_a_flood_of_idle_connections_beyond_the_cap_is_closed_and_peers_still_copy(
    nodes: Any, ports: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, vid = nodes
    pa, pb = ports
    monkeypatch.setattr(peering, "HELLO_S", 2.0)  # the flood is all there before the first times out
    endpoint = pb.endpoint(HOST)
    threads = threading.active_count()
    flood = [socket.create_connection(endpoint) for _ in range(60)]  # the cap is 16
    try:
        assert threading.active_count() <= threads + 1  # a connection is no thread
        # The copy gets through while the flood holds its connections open (strangers make room).
        _copy_is_whole(a, b, vid, pa, pb, "flooded")
        assert pb.turned_away["evicted"] > 0
        assert all(_gone(s) for s in flood)  # each closed: pushed out, or silent past HELLO_S
    finally:
        for s in flood:
            s.close()


def _junk(rng: random.Random, known: PeerKey) -> list[bytes]:
    """Malformed, forged, out-of-range and replayed first frames (none may be taken)."""
    t = _token("fuzz")
    hello = known.seal(Frame(HELLO, t, 0))
    wrong_mac = hello[:-1] + bytes([hello[-1] ^ 1])
    frames = [
        b"",
        b"\0" * HEADER_BYTES,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        struct.pack(">I", 20) + b'{"t": NaN, "w": NaN}',  # the old JSON wire, NaN and all
        struct.pack(">I", 30) + b'{"w": Infinity, "src": 1e400}',
        hello[:HEADER_BYTES - 1],  # cut short: a slow or dead sender
        wrong_mac,  # the job's key id with a forged MAC
        PeerKey(b"\2" * 32).seal(Frame(HELLO, t, 0)),  # another job's key
        known.seal(Frame(CHUNK, t, 0, 1, 0, 4, 0.0, 0)) + b"junk",  # a chunk where the hello is due
        known.seal(Frame(HELLO, t, 0, seq=5)),  # replayed out of order
    ]
    for _ in range(40):
        n = rng.choice([1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, rng.randrange(1, 4096)])
        frames.append(rng.randbytes(n))
    for _ in range(20):  # the job's magic and key id, a random rest
        raw = bytearray(hello)
        raw[21:] = rng.randbytes(len(raw) - 21)
        frames.append(bytes(raw))
    return frames


def test_junk_forged_and_absurd_frames_are_closed_unanswered_and_peers_still_copy(
    nodes: Any, ports: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, vid = nodes
    pa, pb = ports
    endpoint = pb.endpoint(HOST)
    pb.learn(KEY)  # the forgeries below know what the port takes
    crashed: list[Any] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: crashed.append(args.exc_value)
    try:
        for raw in _junk(random.Random(42), KEY):
            with socket.create_connection(endpoint) as s:
                try:
                    s.sendall(raw)
                    s.shutdown(socket.SHUT_WR)
                except OSError:  # closed already
                    pass
                assert _gone(s), raw[:40]  # nothing answered, nothing allocated, closed
    finally:
        threading.excepthook = old_hook
    assert crashed == []
    assert "Traceback" not in caplog.text and "OverflowError" not in caplog.text
    _copy_is_whole(a, b, vid, pa, pb, "after-junk")


def test_an_authenticated_peer_with_absurd_frames_loses_its_connection_and_lands_nothing(
    nodes: Any, ports: Any
) -> None:
    """Even a peer with the key: a payload over the limit, a kind out of range, frames out of order."""
    a, b, vid = nodes
    pa, pb = ports
    endpoint = pb.endpoint(HOST)
    pb.learn(KEY)
    t = _token("absurd")
    bad = [
        Frame(CHUNK, t, 0, 1, 0, (1 << 64) - 1, 0.0, 1),  # 16 EiB announced
        Frame(UNREADABLE, t, 0, 1, 0, 1 << 30, 0.0, 1),  # a payload where none may follow
        Frame(CHUNK, t, 0, 1, 0, 4, 0.0, 7),  # frame 7 where frame 1 is due
        Frame(CHUNK, _token("other"), 0, 1, 0, 4, 0.0, 1),  # another version on this connection
        Frame(HELLO, t, 0, seq=1),  # a second hello
    ]
    for f in bad:
        with _hello(endpoint, t, 0) as s:
            s.sendall(KEY.seal(f) + b"junk")
            assert _gone(s)
    with _hello(endpoint, t, 0) as s:  # 7 is no kind: sealed by hand, as a buggy peer would
        raw = bytearray(KEY.seal(Frame(CHUNK, t, 0, 1, 0, 0, 0.0, 1)))
        raw[4] = 7
        s.sendall(raw)
        assert _gone(s)
    big = (1 << 32) - 1
    with _hello(endpoint, t, big) as s:  # frames nobody asked for, the largest numbers there are: dropped
        s.sendall(KEY.seal(Frame(CHUNK, t, big, 1, 0, 4, 0.0, 1)) + b"junk")
        s.sendall(KEY.seal(Frame(CHUNK, t, big, big, (1 << 64) - 1, 0, 0.0, 2)))
        assert _gone(s)  # then silent past IDLE_S: closed
    assert all(core_of(b).repo.durable["disk"].get(chunk_key(s.move.chunk)) is None for s in _slots(a, vid))
    _copy_is_whole(a, b, vid, pa, pb, "after-absurd")


def test_slow_senders_are_cut_off_and_do_not_hold_up_a_copy(nodes: Any, ports: Any) -> None:
    a, b, vid = nodes
    pa, pb = ports
    endpoint = pb.endpoint(HOST)
    hello = KEY.seal(Frame(HELLO, _token("slow"), 0))
    cut: list[bool] = []

    def dribble() -> None:  # one byte every 50 ms: the whole header would take 5 s, HELLO_S is 0.5 s
        with socket.create_connection(endpoint) as s:
            try:
                for i in range(len(hello)):
                    s.sendall(hello[i:i + 1])
                    time.sleep(0.05)
                cut.append(_gone(s, 1.0))
            except OSError:
                cut.append(True)

    slow = [threading.Thread(target=dribble) for _ in range(8)]
    for t in slow:
        t.start()
    _copy_is_whole(a, b, vid, pa, pb, "beside-slow")
    for t in slow:
        t.join(30)
    assert cut == [True] * 8


@pytest.mark.parametrize(("field", "value", "want"), [
    ("within", math.nan, "within must be seconds"),
    ("within", math.inf, "within must be seconds"),
    ("within", json.loads("1e400"), "within must be seconds"),
    ("within", -1, "within must be seconds"),
    ("within", True, "within must be seconds"),
    ("rank", 1e400, "rank must be an integer"),
    ("rank", 1 << 80, "rank must be an integer"),
    ("rank", "0", "rank must be an integer"),
    ("token", "zz" * 16, "token must be 32 hex digits"),
    ("key", "00" * 8, "key must be 64 hex digits"),
    ("endpoints", {"0": ["h", 70000]}, "a port must be an integer"),
    ("endpoints", {"0": "h:1"}, "the endpoint of rank '0' must be [host, port]"),
    ("endpoints", {"x": ["h", 1]}, "an endpoint's rank must be an integer"),
    ("slots", [[0, 0, "c", math.nan, 0, [1]]], "a slot's nbytes must be an integer"),
    ("slots", [[0, 0, "c", 1 << 50, 0, [1]]], "a slot's nbytes must be an integer"),
    ("slots", [[0, 0, "c", 1, 0, [-1]]], "a slot's dst must be an integer"),
    ("slots", [[0, 0, "c", 1, 0]], "a slot must be [tag, batch, chunk, nbytes, src, dsts]"),
])
def test_every_field_of_a_copy_request_is_checked(field: str, value: Any, want: str) -> None:
    msg = {"token": "ab" * 16, "key": "cd" * 32, "rank": 0, "within": 5.0, "endpoints": {"1": ["127.0.0.1", 9]},
           "slots": [[0, 0, "c", 1, 0, [1]]], field: value}
    with pytest.raises(ValueError, match="^peer_copy: " + re.escape(want)):
        copy_request(msg)
    del msg[field]
    if field in ("within", "endpoints", "slots", "rank", "token", "key"):
        with pytest.raises(ValueError, match=r"^peer_copy: "):
            copy_request(msg)


def test_a_port_request_is_checked() -> None:
    assert port_request({"host": "127.0.0.1"}) == {"host": "127.0.0.1", "key": None}
    assert port_request({"host": "::1", "key": "cd" * 32})["key"].id == PeerKey("cd" * 32).id
    with pytest.raises(ValueError, match=r"^peer_port: host must be an address of this node, not nan"):
        port_request({"host": math.nan})
    with pytest.raises(ValueError, match=r"^peer_port: key must be 64 hex digits"):
        port_request({"host": "127.0.0.1", "key": "cd" * 31 + "zz"})


def test_a_well_formed_copy_request_is_taken_as_sent() -> None:
    args = copy_request({"token": "ab" * 16, "key": "cd" * 32, "rank": 3, "within": 5,
                         "endpoints": {"1": ["127.0.0.1", 9]}, "slots": [[2, 0, "c", 1, 3, [1]]]})
    assert args["token"] == b"\xab" * 16 and args["key"].id == PeerKey("cd" * 32).id
    assert args["rank"] == 3 and args["timeout"] == 5.0 and args["endpoints"] == {1: ("127.0.0.1", 9)}
    [slot] = args["slots"]
    assert (slot.tag, slot.move.chunk, slot.move.nbytes, slot.move.src, slot.move.dsts) == (2, "c", 1, 3, (1,))


def test_frames_are_sealed_with_the_key_and_numbered() -> None:
    key = PeerKey(b"\3" * 32)
    f = Frame(CHUNK, _token("x"), 2, 3, 4, 5, 1.5, 1)
    raw = key.seal(f)
    assert len(raw) == HEADER_BYTES and key.open(raw, 1) == f
    with pytest.raises(ValueError, match="MAC does not match"):
        PeerKey(b"\4" * 32).open(raw, 1)
    with pytest.raises(ValueError, match="frame 1 where frame 2 was due"):
        key.open(raw, 2)
    with pytest.raises(ValueError, match="a peer key is 32 bytes"):
        PeerKey(b"short")


def test_a_64_mib_chunk_moves_whole_between_two_ports(tmp_path: Path) -> None:
    """The largest chunk there is: read straight into its buffer, checked against its id, bit-exact."""
    import tiercache

    cfg = {"chunk_bytes": "64MiB", "pack_below": "4KiB"}
    a = tiercache.open({**cfg, "disk": {"path": str(tmp_path / "a")}})
    b = tiercache.open({**cfg, "disk": {"path": str(tmp_path / "b")}})
    pa, pb = PeerPort(), PeerPort()
    try:
        state = {"w": torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))}
        vid = a.save(state, step=1).wait("durable")
        _copy_is_whole(a, b, vid, pa, pb, "big")
    finally:
        pa.close()
        pb.close()
        a.close()
        b.close()
