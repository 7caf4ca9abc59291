"""Several writers on one cache: refs move by compare-and-swap, conflicts are raised, nothing is lost."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import ConflictError
from tiercache.manifest import RefRecord, new_version_id

sys.path.insert(0, str(Path(__file__).parent))
from _crash_child import ForkServer  # the child script lives next to the tests


def _history(root: Path, branch: str) -> list[str]:
    """Version ids from the head of ``branch`` back to its first version, read by a fresh cache."""
    with tiercache.open({"disk": {"path": str(root)}}) as cache:
        parents = {v.id: v.parent for v in cache.versions()}
        out: list[str] = []
        vid: str | None = cache.resolve(branch)
        while vid is not None:
            out.append(vid)
            vid = parents[vid]
    return out


def _cfg(root: Path) -> dict:
    return {"disk": {"path": str(root)}, "policy": {"name": "write-through"}}


def test_a_stale_writer_gets_conflict_and_its_retry_lands_on_the_new_head(tmp_path: Path) -> None:
    with tiercache.open(_cfg(tmp_path)) as a:
        base = a.save({"x": torch.zeros(4)}, step=0)
        base.wait("local")
        with tiercache.open(_cfg(tmp_path)) as b:
            assert b.resolve("main") == base.version
            moved = a.save({"x": torch.ones(4)}, step=1)
            moved.wait("local")
            stale = b.save({"x": torch.full((4,), 2.0)}, step=1)
            with pytest.raises(ConflictError, match="moved by another writer"):
                stale.wait("local")
            assert not stale.succeeded("local")
            assert b.manifest(stale.version).parent == base.version  # stored, but not on the branch
            assert b.resolve("main") == moved.version  # b follows the other writer's head
            retry = b.save({"x": torch.full((4,), 3.0)}, step=2)
            assert retry.wait("local") == retry.version
            assert b.manifest(retry.version).parent == moved.version
    assert _history(tmp_path, "main") == [retry.version, moved.version, base.version]
    with tiercache.open(_cfg(tmp_path)) as c:
        assert torch.equal(c.restore("main")["x"], torch.full((4,), 3.0))


def test_a_head_read_before_a_save_never_moves_the_branch_back(tmp_path: Path) -> None:
    """What catch-up does when a save overtakes it: it read the head, copied it, then writes its ref.

    The head it read (another process's move, never one of this process's) is older than the
    save this process made meanwhile: writing it must leave the newer head where it is.
    """
    with tiercache.open(_cfg(tmp_path)) as a:
        a.save({"x": torch.zeros(4)}, step=0).wait("local")
    with tiercache.open(_cfg(tmp_path)) as b:
        cat = core_of(b).catalog
        read = cat.ref("branch", "main")  # catch-up takes its snapshot of the heads
        assert read is not None
        newer = b.save({"x": torch.ones(4)}, step=1)
        assert newer.wait("local") == newer.version  # the save overtakes it
        assert cat.write_ref("disk", read) is False  # left alone, as a rollback's overtaken move is
        assert b.resolve("main") == newer.version
    assert _history(tmp_path, "main")[0] == newer.version


def test_a_head_read_before_a_save_still_brings_a_lagging_tier_forward(tmp_path: Path, s3_config: S3Config) -> None:
    """Catch-up's copy of an older head reaches a tier that lags behind it even after a save overtook it."""
    s3 = s3_config.model_dump(mode="json")
    both = {**_cfg(tmp_path), "s3": s3}
    with tiercache.open(both) as a:
        first = a.save({"x": torch.zeros(4)}, step=0)
        assert first.wait("remote") == first.version
    with tiercache.open(_cfg(tmp_path)) as a:  # S3 misses this one: it lags behind the disk
        second = a.save({"x": torch.ones(4)}, step=1)
        assert second.wait("local") == second.version
    with tiercache.open(both) as b:
        cat = core_of(b).catalog
        read = cat.ref("branch", "main")
        assert read is not None and read.version == second.version
        # A save of this process moves the branch on (noted, not yet written anywhere)...
        ahead = RefRecord(kind="branch", name="main", version=new_version_id(), seq=read.seq + 1)
        cat.note_move(ahead, read)
        # ...and catch-up, done copying, writes the head it read: S3 comes forward, the view stays.
        assert cat.write_ref("s3", read) is True
        assert cat.ref("branch", "main") == ahead
        assert cat.ref_on("s3", "branch", "main") == read
        # The save's own commit there replaces it in turn: it was based on that head.
        assert cat.write_ref("s3", ahead) is True
        assert cat.ref_on("s3", "branch", "main") == ahead


def test_own_rollback_overtaking_an_own_pending_save_is_not_a_conflict(tmp_path: Path) -> None:
    with tiercache.open(_cfg(tmp_path)) as cache:
        first = cache.save({"x": torch.zeros(4)}, step=0)
        first.wait("local")
        second = cache.save({"x": torch.ones(4)}, step=1)
        cache.rollback("main", first.version)
        assert second.wait("local") == second.version  # stored; the newer rollback stays the head
        assert cache.resolve("main") == first.version
    assert _history(tmp_path, "main") == [first.version]


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    srv = ForkServer()
    yield srv
    srv.close()


def _run_writers(server: ForkServer, root: Path, branches: list[str], count: int) -> list[dict]:
    """Race one forked writer process per entry of ``branches``; return what each landed and lost."""
    go = root.parent / f"{root.name}.go"
    specs = [
        {"mode": "commits", "root": str(root), "branch": br, "writer": i, "count": count, "go": str(go),
         "out": str(root.parent / f"writer{i}.json"), "log": str(root.parent / "writers.log")}
        for i, br in enumerate(branches)
    ]
    server.start(specs)
    go.touch()
    codes = server.reap()
    log = (root.parent / "writers.log").read_text() if (root.parent / "writers.log").exists() else ""
    assert codes == [0] * len(specs), log[-2000:]
    return [json.loads(Path(s["out"]).read_text()) for s in specs]


def test_four_writers_on_one_branch_lose_nothing_and_other_branches_never_conflict(
    server: ForkServer, tmp_path: Path, slow: bool
) -> None:
    count = 100 if slow else 50  # the issue asks for 4 x 50 in CI; --slow doubles it
    root = tmp_path / "cache"
    with tiercache.open(_cfg(root)) as cache:
        cache.save({"w": torch.zeros(4)}, step=0).wait("local")
        for name in ("a", "b"):
            cache.branch(name, "main")
        base = cache.resolve("main")
    # Four writers race on main while two more write their own branches in the same directory.
    results = _run_writers(server, root, ["main"] * 4 + ["a", "b"], count)
    mains, others = results[:4], results[4:]
    landed = [v for r in mains for v in r["landed"]]
    conflicted = {v for r in mains for v in r["conflicted"]}
    history = _history(root, "main")
    assert len(landed) == 4 * count
    assert len(history) == len(landed) + 1  # every landed commit is on the branch: 0 lost updates
    assert set(history) == set(landed) | {base}
    assert not conflicted & set(history)  # a conflicted commit never reached the branch
    for r in mains:  # each writer's commits appear in its own order
        pos = [history.index(v) for v in r["landed"]]
        assert pos == sorted(pos, reverse=True)
    assert [len(r["conflicted"]) for r in others] == [0, 0]
    for name, r in zip(("a", "b"), others, strict=True):
        assert _history(root, name) == [*reversed(r["landed"]), base]
    print(f"concurrent writers: {len(landed)} commits landed, {len(conflicted)} conflicts raised, 0 lost")
