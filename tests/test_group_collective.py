"""The group's collective layer (tiercache.group.collective): tagged exchanges over a real TCPStore.

Ranks are simulated by threads of this process, each with its own :class:`Collective` on one
store server, so every fault (a rank that raises, never answers, comes late, dies, or a store that
goes away) is driven on purpose and every rank's verdict is compared.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tiercache import failpoints
from tiercache.errors import GroupBrokenError, GroupSaveError, InvalidArgumentError
from tiercache.group.collective import Collective, Decision, Verdict
from tiercache.group.phase_status import OK, Status


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def group(store: dist.Store, world: int, **kw: Any) -> list[Collective]:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    prefixed = dist.PrefixStore("t/", client)
    opts = {"timeout": 1.0, "heartbeat": 0.05, "dead_after": 0.6, **kw}
    return [Collective(prefixed, r, world, **opts) for r in range(world)]


def run(ranks: list[Collective], body: Callable[[Collective], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(body, ranks))


def failure(v: Verdict) -> tuple[str, str]:
    err = v.status.error_object()
    return type(err).__name__, str(err)


def test_every_rank_gets_the_decision_and_its_own_share(store: dist.TCPStore) -> None:
    ranks = group(store, 3)

    def decide(statuses: list[Status]) -> Decision:
        total = sum(s.payload for s in statuses)
        return Decision(total, [f"share of {r}" for r in range(len(statuses))])

    out = run(ranks, lambda c: c.channel().exchange("v1/sum", Status("ok", c.rank + 1), what="v1", decide=decide))
    assert [(v.ok, v.status.payload, v.mine) for v in out] == [(True, 6, f"share of {r}") for r in range(3)]
    # Nothing is left in the store once every rank read the verdict (but the heartbeats).
    keys = [k for k in store.list_keys() if "/hb/" not in k]
    assert keys == [], keys


def test_a_rank_error_fails_the_phase_on_every_rank_with_its_type_and_name(store: dist.TCPStore) -> None:
    ranks = group(store, 3)

    def body(c: Collective) -> Verdict:
        mine = Status.of(InvalidArgumentError("meta must be JSON-able")) if c.rank == 1 else OK
        return c.channel().exchange("v1/begin", mine, what="the save of step 3")

    out = run(ranks, body)
    assert {failure(v) for v in out} == {
        ("InvalidArgumentError", "the save of step 3 failed: rank 1: InvalidArgumentError: meta must be JSON-able")}
    # A failed phase leaves the group usable: the next one goes through.
    assert all(v.ok for v in run(ranks, lambda c: c.channel().exchange("v2/begin", OK, what="v2")))


def test_a_rank_that_dies_right_after_posting_its_status_does_not_hang_the_coordinator(store: dist.TCPStore) -> None:
    """Its status is in the store, but it never told the coordinator so: the coordinator decides all the same.

    (It used to wait for that word forever: a chaos run's rank, killed on another of its threads
    right there, left rank 0 looping past its timeout.)
    """
    ranks = group(store, 2, dead_after=30.0)

    def die_after_posting(tag: str, rank: int) -> None:
        if rank == 1:
            raise SystemExit("rank 1 dies here")

    def body(c: Collective) -> Verdict | str:
        try:
            return c.channel().exchange("v1/parts", Status("ok", c.rank), what="version v1 at parts",
                                        decide=lambda st: Decision(sum(s.payload for s in st)))
        except SystemExit as e:
            return str(e)

    with failpoints.hooked("group.posted", die_after_posting):
        out = run(ranks, body)
    assert out[1] == "rank 1 dies here"
    assert isinstance(out[0], Verdict) and out[0].ok and out[0].status.payload == 1  # both statuses counted


def test_a_rank_that_does_not_answer_is_named_and_learns_the_outcome_when_it_comes(store: dist.TCPStore) -> None:
    ranks = group(store, 3, dead_after=30.0)
    late: list[Verdict] = []

    def body(c: Collective) -> Verdict | None:
        if c.rank == 2:
            time.sleep(2.5)  # past the timeout (1 s) and the others' patience (1 s + 5 s margin is for rank 0)
            late.append(c.channel().exchange("v1/hashed", OK, what="version v1 at hashing"))
            return None
        return c.channel().exchange("v1/hashed", OK, what="version v1 at hashing")

    out = run(ranks, body)
    want = ("GroupSaveError", "version v1 at hashing failed: rank 2 did not answer within 1s")
    assert failure(out[0]) == failure(out[1]) == failure(late[0]) == want
    assert all(c.broken is None for c in ranks)  # slow is not dead
    assert [k for k in store.list_keys() if "/hb/" not in k] == []


def test_a_coordinator_that_comes_too_late_gets_the_failure_the_others_set(store: dist.TCPStore) -> None:
    ranks = group(store, 2, dead_after=60.0)
    decided: list[bool] = []

    def body(c: Collective) -> Verdict:
        if c.rank == 0:
            time.sleep(7.0)  # past the others' patience: timeout 1 s + 5 s margin
        return c.channel().exchange("v1/disk", OK, what="version v1 on disk",
                                    decide=lambda s: decided.append(True) or Decision())

    out = run(ranks, body)
    want = ("GroupSaveError", "version v1 on disk failed: rank 0 did not answer within 1s")
    assert failure(out[0]) == failure(out[1]) == want
    assert decided == []  # the late coordinator never decided (nor committed anything)


def test_a_dead_rank_breaks_the_group_once_and_later_phases_fail_at_once(store: dist.TCPStore) -> None:
    ranks = group(store, 3, timeout=30.0)
    ranks[2].close()  # its heartbeat stops, as when the process is killed

    def body(c: Collective) -> Verdict | None:
        if c.rank == 2:
            return None
        return c.channel().exchange("v1/parts", OK, what="version v1 at parts")

    t0 = time.monotonic()
    out = run(ranks, body)
    assert time.monotonic() - t0 < 30  # the heartbeat told, not the 30 s timeout
    name, message = failure(out[0])
    assert (name, message) == failure(out[1])
    assert (name, message) == ("GroupBrokenError", "version v1 at parts failed: rank 2 is gone (no heartbeat for "
                                                   "0.6s): the process group is broken; restart the job")
    # Later phases fail at once, with one reason that names no phase (so it is the same on every
    # rank, whichever phase each one learnt it in).
    later = run(ranks[:2], lambda c: c.channel().exchange("v2/begin", OK, what="v2"))
    assert {failure(v) for v in later} == {
        ("GroupBrokenError", "the process group is broken: rank 2 is gone (no heartbeat for 0.6s); restart the job")}
    assert isinstance(ranks[0].broken, GroupBrokenError)


def test_the_coordinator_does_not_linger_at_close_for_a_rank_that_is_gone(store: dist.TCPStore) -> None:
    ranks = group(store, 3)
    assert [v.ok for v in run(ranks, lambda c: c.channel().exchange("v1/parts", OK, what="v1"))] == [True] * 3
    ranks[2].close()  # killed before it read the verdict of v2
    out = run(ranks[:2], lambda c: c.channel().exchange("v2/parts", OK, what="v2"))
    assert [failure(v)[0] for v in out] == ["GroupBrokenError"] * 2
    t0 = time.monotonic()
    ranks[0].close(linger=60)  # the verdict of v2 stays unread by rank 2 for good
    assert time.monotonic() - t0 < 30  # its heartbeat told, not the 60 s linger
    ranks[1].close()


def test_a_failing_decision_fails_the_phase_naming_rank_0_and_the_group_goes_on(store: dist.TCPStore) -> None:
    ranks = group(store, 2)

    def decide(statuses: list[Status]) -> Decision:
        raise InvalidArgumentError("the ranks hash with different algorithms")

    out = run(ranks, lambda c: c.channel().exchange("v1/parts", OK, what="version v1", decide=decide))
    assert {failure(v) for v in out} == {
        ("InvalidArgumentError",
         "version v1 failed: rank 0: InvalidArgumentError: the ranks hash with different algorithms")}
    assert all(c.broken is None for c in ranks)
    assert all(v.ok for v in run(ranks, lambda c: c.channel().exchange("v2/parts", OK, what="v2")))


def test_a_store_that_goes_away_breaks_the_group_with_that_reason() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, datetime, torch.distributed as d; "
         "s = d.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False); "
         "print(s.port, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        ranks = [Collective(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5)), r, 2,
                            timeout=5.0, heartbeat=0.05) for r in range(2)]
        channels = [c.channel() for c in ranks]
        assert all(v.ok for v in run(ranks, lambda c: channels[c.rank].exchange("v1/a", OK, what="v1")))
        server.kill()
        server.wait()
        out = run(ranks, lambda c: channels[c.rank].exchange("v2/a", OK, what="version v2 at begin"))
        for v in out:
            name, message = failure(v)
            # It says that other ranks may have read a verdict this one could not, and what to do.
            assert (name, message) == ("GroupBrokenError", (
                "the process group is broken: the job's store stopped answering (its host, rank 0 or the launcher, "
                "is gone), so a version whose verdict this rank had not read is reported failed here though other "
                "ranks may report it durable (a restore after the restart finds it if it was committed); the store "
                "must outlive the ranks: launch with torchrun, whose agent hosts it, not with a store rank 0 hosts "
                "(mp.spawn, init_method='tcp://'); restart the job"))
    finally:
        server.kill()


def test_statuses_round_trip_and_unknown_error_types_become_group_errors() -> None:
    s = Status("error", error="ZeroDivisionError", message="division by zero", extra={"missing": [1]})
    assert Status.decode(s.encode()) == s
    err = s.error_object()
    assert type(err) is GroupSaveError and str(err) == "ZeroDivisionError: division by zero"
    with pytest.raises(GroupSaveError, match="cannot read"):
        Status.decode(b"\x80not json")


def test_many_statuses_decode_in_one_parse_as_one_by_one() -> None:
    statuses = [OK, Status("ok", 0), Status("ok", {"chunks": [["a", 1]]}), Status("skip", message="full"),
                Status("error", error="ValueError", message="bad meta", extra={"missing": [2]}), OK, Status("ok", 0),
                Status("ok", {"chunks": [["a", 1]]})]
    blobs = [s.encode() for s in statuses]
    decoded = Status.decode_all(blobs)
    assert decoded == [Status.decode(b) for b in blobs] == statuses
    assert decoded[0] is decoded[5]  # an equal status with nothing mutable is one object
    assert decoded[2].payload is not decoded[7].payload  # a mutable payload is each rank's own
    assert Status.decode_all([]) == []
    for bad in (b"\x80not json", b"", b'["ok",1,"",""', b'["maybe",null,"","",{}]', b'1,2'):
        with pytest.raises(GroupSaveError, match="cannot read"):
            Status.decode_all([blobs[0], bad, blobs[1]])
    assert threading.active_count() >= 1
