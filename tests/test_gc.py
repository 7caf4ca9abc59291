"""Garbage collection: what is live, what is freed, grace for saves in flight, crash between phases.

Liveness: a version is kept when a branch head or a tag reaches it through parent links; versions
orphaned by a rollback are collected with the chunks no remaining manifest names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache import failpoints
from tiercache.cache import TierCache, core_of
from tiercache.config import S3Config
from tiercache.errors import IntegrityError, StorageError, VersionNotFoundError
from tiercache.names import chunk_key, version_key
from tiercache.tiers.disk import DiskTier

T = 16 * 1024  # float32 elements: 64 KiB, one chunk per tensor


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(T, generator=g) for i in range(4)}


def _cfg(root: Path, **extra: object) -> dict[str, object]:
    # reflog_keep=0: the moves these tests make leave nothing protected by the reflog (its own
    # test below keeps the default).
    return {"disk": {"path": str(root)}, "chunk_bytes": "64KiB", "pack_below": "4KiB", "reflog_keep": 0, **extra}


def _files(root: Path, sub: str) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / sub).rglob("*") if p.is_file() and ".tmp" not in p.name}


def _chunk_ids(cache: TierCache, ref: str) -> set[str]:
    return {c.id for c in cache.manifest(ref).chunks}


def _save(cache: TierCache, state: dict[str, torch.Tensor], step: int, branch: str = "main") -> str:
    return cache.save(state, step=step, branch=branch).wait("durable")


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[TierCache]:
    with tiercache.open(_cfg(tmp_path)) as c:
        yield c


def _history(cache: TierCache) -> tuple[dict[str, torch.Tensor], list[str], list[dict[str, torch.Tensor]]]:
    """main: v1 <- v2 (w1 changed) <- v3 (w2 changed); returns v1's state, ids and states."""
    s1 = _state()
    s2 = dict(s1, w1=s1["w1"] + 1)
    s3 = dict(s2, w2=s2["w2"] + 1)
    ids = [_save(cache, s, i + 1) for i, s in enumerate((s1, s2, s3))]
    return s1, ids, [s1, s2, s3]


def test_rollback_then_gc_frees_exactly_the_orphaned_unique_chunks(cache: TierCache, tmp_path: Path) -> None:
    s1, (v1, v2, v3), _ = _history(cache)
    orphan_chunks = (_chunk_ids(cache, v2) | _chunk_ids(cache, v3)) - _chunk_ids(cache, v1)
    assert len(orphan_chunks) == 2  # w1 of v2 (shared by v3) and w2 of v3
    cache.rollback("main", v1)
    before = _files(tmp_path, "chunks") | _files(tmp_path, "versions")
    orphan_keys = [chunk_key(c) for c in orphan_chunks] + [version_key(v) for v in (v2, v3)]
    orphan_bytes = sum((tmp_path / k).stat().st_size for k in orphan_keys)  # as stored (maybe compressed)

    dry = cache.gc(dry_run=True, grace=0)
    assert _files(tmp_path, "chunks") | _files(tmp_path, "versions") == before  # deleted nothing
    report = cache.gc(grace=0)
    for r in (dry, report):
        assert r.versions == (v2, v3)
        assert r.manifests == {"disk": 2} and r.chunks == {"disk": 2}
        assert r.bytes_freed == {"disk": orphan_bytes}
    assert dry.dry_run and not report.dry_run

    assert _files(tmp_path, "chunks") == {chunk_key(c) for c in _chunk_ids(cache, v1)}
    assert _files(tmp_path, "versions") == {version_key(v1)}
    assert [v.id for v in cache.versions()] == [v1]
    with pytest.raises(VersionNotFoundError):
        cache.resolve(v3)
    got = cache.restore("main")
    assert all(torch.equal(got[k], s1[k]) for k in s1)
    again = cache.gc(grace=0)
    assert again.versions == () and again.total_bytes == 0 and again.chunks == {"disk": 0}


def test_tags_and_branch_heads_survive_with_their_lineage(cache: TierCache, tmp_path: Path) -> None:
    s1, (v1, v2, v3), states = _history(cache)
    cache.tag("best", v2)
    cache.branch("ft", v3)
    sf = dict(states[2], w3=states[2]["w3"] * 2)
    f1 = _save(cache, sf, 4, branch="ft")
    cache.rollback("main", v1)
    # v2 is tagged; v3 is f1's parent on ft: nothing is orphaned yet.
    kept = cache.gc(grace=0)
    assert kept.versions == () and kept.total_bytes == 0
    assert [v.id for v in cache.versions()] == [v1, v2, v3, f1]

    cache.rollback("ft", v1)  # now v3 and f1 are reachable from nothing
    unique = (_chunk_ids(cache, v3) | _chunk_ids(cache, f1)) - _chunk_ids(cache, v1) - _chunk_ids(cache, v2)
    report = cache.gc(grace=0)
    assert report.versions == tuple(sorted((v3, f1)))
    assert report.chunks == {"disk": len(unique)} == {"disk": 2}
    assert cache.refs() == {"branch/ft": v1, "branch/main": v1, "tag/best": v2}
    for ref, want in (("best", states[1]), ("main", s1), ("ft", s1)):
        got = cache.restore(ref)
        assert all(torch.equal(got[k], want[k]) for k in want), ref
    assert cache.manifest("best").parent == v1  # lineage of a tag is kept
    assert cache.verify().ok
    assert cache.gc(grace=0).total_bytes == 0


def test_the_reflog_keeps_what_a_rollback_left_behind_until_it_expires(tmp_path: Path) -> None:
    with tiercache.open(_cfg(tmp_path, reflog_keep=3600)) as cache:
        _, (v1, v2, v3), _ = _history(cache)
        cache.rollback("main", v1)
        moves = cache.reflog("main")
        assert [(m.why, m.previous, m.version) for m in moves] == [
            ("save", None, v1), ("save", v1, v2), ("save", v2, v3), ("rollback", v3, v1)]
        kept = cache.gc(grace=0)
        assert kept.versions == () and kept.total_bytes == 0
        assert len(_files(tmp_path, "reflog")) == 1
    # A later process with a shorter reflog_keep: the entry has expired; the versions go with it.
    with tiercache.open(_cfg(tmp_path, reflog_keep=0)) as later:
        assert [m.why for m in later.reflog("main")] == ["save", "save", "save", "rollback"]
        report = later.gc(grace=0)
        assert report.versions == (v2, v3)
        assert _files(tmp_path, "reflog") == set()
        assert [m.why for m in later.reflog("main")] == ["save"]


def test_a_new_branch_after_gc_never_names_a_collected_version_as_parent(tmp_path: Path) -> None:
    # Found by tests/test_state_machine.py: the version this process last saved was collected,
    # and a save on a new branch (which starts from the last saved version) still named it.
    with tiercache.open(_cfg(tmp_path, reflog_keep=0)) as cache:
        v1 = cache.save({"w": torch.zeros(8)}, step=1).wait("local")
        v2 = cache.save({"w": torch.ones(8)}, step=2, branch="ft").wait("local")
        cache.rollback("ft", v1)
        assert cache.gc(grace=0).versions == (v2,)
        v3 = cache.save({"w": torch.ones(8)}, step=3, branch="dev").wait("local")
        assert {v.id: v.parent for v in cache.versions()} == {v1: None, v3: None}


def test_a_hole_in_the_lineage_keeps_every_older_version_of_the_branch(cache: TierCache, tmp_path: Path) -> None:
    _, (v1, v2, v3), _ = _history(cache)
    (tmp_path / version_key(v2)).unlink()  # v3 now names a parent that no tier holds
    with tiercache.open(_cfg(tmp_path)) as fresh:
        report = fresh.gc(grace=0)
        assert report.versions == ()
        assert [v.id for v in fresh.versions()] == [v1, v3]


def test_default_grace_keeps_young_orphans(cache: TierCache) -> None:
    _, (v1, v2, v3), _ = _history(cache)
    cache.rollback("main", v1)
    report = cache.gc()
    assert report.grace == 3600.0
    assert report.versions == () and report.total_bytes == 0
    assert [v.id for v in cache.versions()] == [v1, v2, v3]


class _GatedManifestPut:
    """Holds DiskTier.put of manifests until ``gate`` is set: a save stuck between chunks and manifest."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        real = DiskTier.put

        def put(tier: DiskTier, key: str, data: object, **kw: bool) -> None:
            if key.startswith("versions/"):
                self.entered.set()
                self.gate.wait(30)
            real(tier, key, data, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(DiskTier, "put", put)


def test_save_in_flight_is_never_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tiercache.open(_cfg(tmp_path)) as cache:
        s1 = _state()
        v1 = _save(cache, s1, 1)
        gated = _GatedManifestPut(monkeypatch)
        s2 = {k: v + 5 for k, v in s1.items()}
        h2 = cache.save(s2, step=2)
        assert gated.entered.wait(30)  # v2's chunks are on disk, its manifest and ref are not
        new_chunks = {chunk_key(c) for c in _chunk_ids(cache, h2.version)}
        assert new_chunks <= _files(tmp_path, "chunks") and len(new_chunks) == 4

        # This process knows the save is pending: even grace 0 keeps it.
        mine = cache.gc(grace=0)
        assert mine.versions == () and mine.chunks == {"disk": 0}
        # Another process sees only unreferenced chunks; the grace period is what keeps them.
        with tiercache.open(_cfg(tmp_path)) as other:
            assert other.gc(grace=0, dry_run=True).chunks == {"disk": 4}  # what grace protects against
            theirs = other.gc()
            assert theirs.chunks == {"disk": 0} and theirs.spared == 4
        assert new_chunks <= _files(tmp_path, "chunks")

        gated.gate.set()
        assert h2.wait("local") == h2.version
        got = cache.restore("main")
        assert all(torch.equal(got[k], s2[k]) for k in s2)
        assert cache.gc(grace=0).total_bytes == 0
    with tiercache.open(_cfg(tmp_path)) as fresh:
        assert [v.id for v in fresh.versions()] == [v1, h2.version]
        got = fresh.restore("main")
        assert all(torch.equal(got[k], s2[k]) for k in s2)


def test_crash_between_manifest_and_chunk_deletes_is_finished_by_the_next_gc(
    cache: TierCache, tmp_path: Path
) -> None:
    s1, (v1, _, _), _ = _history(cache)
    cache.rollback("main", v1)
    failpoints.configure("gc.after_manifest_delete=raise")
    try:
        with pytest.raises(StorageError, match=r"gc\.after_manifest_delete"):
            cache.gc(grace=0)
    finally:
        failpoints.configure(None)
    assert _files(tmp_path, "versions") == {version_key(v1)}
    assert len(_files(tmp_path, "chunks")) == 6  # v1's 4 + 2 orphans, no manifest names them now
    with tiercache.open(_cfg(tmp_path)) as fresh:
        report = fresh.gc(grace=0)
        assert report.versions == () and report.chunks == {"disk": 2}
        got = fresh.restore("main")
        assert all(torch.equal(got[k], s1[k]) for k in s1)
        assert fresh.verify().ok


@pytest.mark.s3
def test_gc_on_disk_and_s3(tmp_path: Path, s3_config: S3Config) -> None:
    with tiercache.open(_cfg(tmp_path, s3=s3_config.model_dump(), policy={"name": "write-through"})) as cache:
        s1, (v1, v2, v3), _ = _history(cache)
        # Uploads still in flight keep their versions live; wait for S3 so all three are settled.
        cache.flush()
        cache.rollback("main", v1)
        report = cache.gc(grace=0)
        assert report.versions == (v2, v3)
        assert report.chunks == {"disk": 2, "s3": 2} and report.manifests == {"disk": 2, "s3": 2}
        s3 = core_of(cache).repo.durable["s3"]
        assert s3.list("chunks/") == sorted(chunk_key(c) for c in _chunk_ids(cache, v1))
        assert s3.list("versions/") == [version_key(v1)]
        young = cache.gc(dry_run=True)  # S3 objects carry their age too: nothing is old enough
        assert young.total_bytes == 0
        got = cache.restore("main")
        assert all(torch.equal(got[k], s1[k]) for k in s1)


def test_a_listing_that_hides_manifests_never_lets_gc_free_what_a_ref_reaches(
        tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch) -> None:
    # An S3 whose listings leave out manifests (as a store behind on its index may): gc reads each
    # version a ref reaches by its key, and frees nothing those versions name.
    from tiercache.tiers.s3 import S3Tier

    cfg = {"s3": s3_config.model_dump(mode="json")}
    states = [{"w": torch.full((1 << 16,), float(i))} for i in range(3)]
    with tiercache.open(cfg) as cache:
        vids = [cache.save(s, step=i).wait("remote") for i, s in enumerate(states)]
    hidden = {f"versions/{v}.json" for v in vids[:2]}
    real_list = S3Tier.list
    monkeypatch.setattr(S3Tier, "list", lambda self, prefix="": [k for k in real_list(self, prefix) if k not in hidden])
    with tiercache.open(cfg) as cache:
        report = cache.gc(grace=0)
        assert report.versions == () and sum(report.chunks.values()) == 0
    monkeypatch.setattr(S3Tier, "list", real_list)
    with tiercache.open(cfg) as cache:
        for vid, s in zip(vids, states, strict=True):
            assert torch.equal(cache.restore(vid)["w"], s["w"])


def test_gc_refuses_while_a_ref_points_at_a_version_no_tier_holds(tmp_path: Path) -> None:
    cfg = {"disk": {"path": str(tmp_path / "d")}}
    with tiercache.open(cfg) as cache:
        a = cache.save({"w": torch.ones(8)}, step=1).wait("local")
        b = cache.save({"w": torch.zeros(8)}, step=2).wait("local")
    (tmp_path / "d" / "versions" / f"{b}.json").unlink()  # the head's manifest is gone
    with tiercache.open(cfg) as cache, pytest.raises(IntegrityError, match=(
            rf"^gc refused: a ref points at version {b}, which no tier holds a readable manifest of, so what it "
            r"reaches cannot be told: run `tiercache verify`$")):
        cache.gc(grace=0)
    with tiercache.open(cfg) as cache:
        assert torch.equal(cache.restore(a)["w"], torch.ones(8))  # nothing was collected
