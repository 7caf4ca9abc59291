"""The catalog's index (docs/design.md section 3, "What grows"): listing reads no manifest, a restore one.

Every test counts the manifests parsed (``Version.from_json``, wrapped) in a fresh process's
view (a new :func:`tiercache.open`) and checks what it lists and restores against what was saved.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache import failpoints
from tiercache.cache import core_of
from tiercache.cli import app
from tiercache.config import S3Config
from tiercache.errors import StorageError, VersionNotFoundError
from tiercache.handle import SaveHandle
from tiercache.manifest import ChunkRef, Piece, PrunedRecord, RefRecord, TensorEntry, Version, VersionStatus, utcnow
from tiercache.names import CHUNKS
from tiercache.parts import group_header, part_of
from tiercache.repo import index
from tiercache.tiers.s3 import S3Tier

MIB = 1 << 20
N = 8


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(256, dtype=torch.float32) + step, "b": torch.full((3,), step, dtype=torch.int64),
            "step": step}


def _disk(tmp_path: Path) -> dict[str, Any]:
    # reflog_keep 0: gc may collect a rolled-back version at once.
    return {"disk": {"path": str(tmp_path / "disk")}, "policy": {"name": "write-through"}, "reflog_keep": 0}


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The sources of the manifests parsed while the test runs (``tier:versions/<id>.json``)."""
    real = Version.from_json
    seen: list[str] = []

    def counting(data: bytes, *, source: str = "") -> Version:
        seen.append(source)
        return real(data, source=source)

    monkeypatch.setattr(Version, "from_json", staticmethod(counting))
    yield seen


def _save(cfg: dict[str, Any], n: int = N, level: str = "local") -> list[str]:
    with tiercache.open(cfg) as cache:
        return [cache.save(_state(i), step=i, meta={"loss": 1.0 / (i + 1)}).wait(level) for i in range(n)]


def _listing(cfg: dict[str, Any]) -> list[tuple[str, str | None, int, dict[str, Any], tuple[str, ...]]]:
    with tiercache.open(cfg) as cache:
        return [(v.id, v.parent, v.step, v.meta, v.tiers) for v in cache.versions()]


def _expected(ids: list[str], tiers: tuple[str, ...] = ("disk",)) -> list[Any]:
    return [(vid, ids[i - 1] if i else None, i, {"loss": 1.0 / (i + 1)}, tiers) for i, vid in enumerate(ids)]


def _saves_then_a_crash_after_the_third_manifest(
        cache: tiercache.TierCache, level: str) -> tuple[list[str], SaveHandle]:
    """Two versions acknowledged at ``level``, then a third whose commit stops right after its manifest is durable."""
    acked = [cache.save(_state(i), step=i).wait(level) for i in range(2)]
    failpoints.configure("repo.after_manifest_write=raise")
    try:
        third = cache.save(_state(2), step=2)
        with pytest.raises(StorageError, match=r"failpoint repo\.after_manifest_write"):
            third.wait(level)
    finally:
        failpoints.configure(None)
    return acked, third


def test_ls_parses_no_manifest_and_restoring_the_newest_parses_exactly_one(tmp_path: Path,
                                                                            parsed: list[str]) -> None:
    cfg = _disk(tmp_path)
    ids = _save(cfg)
    parsed.clear()
    assert _listing(cfg) == _expected(ids)
    with tiercache.open(cfg) as cache:
        assert [m.version for m in cache.reflog()] == ids
        assert cache.resolve("main~3") == ids[-4] and cache.resolve("main@2") == ids[2]
        assert parsed == []
        out = cache.restore("main")
        assert parsed == [f"disk:versions/{ids[-1]}.json"]
        assert torch.equal(out["w"], _state(N - 1)["w"]) and torch.equal(out["b"], _state(N - 1)["b"])
        assert out["step"] == N - 1
        assert torch.equal(cache.restore(ids[3])["w"], _state(3)["w"])
        assert parsed == [f"disk:versions/{ids[-1]}.json", f"disk:versions/{ids[3]}.json"]


def test_the_cli_ls_and_log_parse_no_manifest(tmp_path: Path, parsed: list[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\n[policy]\nname = "write-through"\n')
    ids = _save(_disk(tmp_path), n=4)
    parsed.clear()
    runner = CliRunner()
    listing = runner.invoke(app, ["--config", str(config), "ls", "--json"])
    assert listing.exit_code == 0, listing.output
    assert [v["id"] for v in json.loads(listing.stdout)] == ids
    log = runner.invoke(app, ["--config", str(config), "log"])
    assert log.exit_code == 0 and all(vid in log.stdout for vid in ids)
    assert parsed == []


def _index_files(root: Path, kind: str = "versions") -> list[Path]:
    return sorted((root / "index" / kind).glob("*.jsonl"))


@pytest.mark.parametrize("damage", ["lost", "garbage", "torn", "stale"])
def test_a_lost_or_damaged_index_is_rebuilt_and_ls_stays_right(tmp_path: Path, parsed: list[str],
                                                               damage: str) -> None:
    cfg = _disk(tmp_path)
    ids = _save(cfg)
    [seg] = _index_files(tmp_path / "disk")
    lines = seg.read_bytes().splitlines(keepends=True)
    assert [json.loads(line)["id"] for line in lines] == ids
    if damage == "lost":
        seg.unlink()
        hit = ids
    elif damage == "garbage":
        seg.write_bytes(lines[0] + b"\x00\xffnot json\n" + b"".join(lines[2:]))
        hit = [ids[1]]
    elif damage == "torn":  # a write cut short: the last line half there
        seg.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
        hit = [ids[-1]]
    else:  # a line of a known id whose fields are wrong (an older format, say)
        bad = json.loads(lines[4])
        bad["step"] = "four"
        seg.write_bytes(b"".join(lines[:4]) + json.dumps(bad).encode() + b"\n" + b"".join(lines[5:]))
        hit = [ids[4]]
    parsed.clear()
    assert _listing(cfg) == _expected(ids)
    assert sorted(parsed) == sorted(f"disk:versions/{vid}.json" for vid in hit)  # only what the index missed
    parsed.clear()
    assert _listing(cfg) == _expected(ids)
    assert parsed == []  # repaired: the next process parses nothing
    with tiercache.open(cfg) as cache:
        assert torch.equal(cache.restore("main")["w"], _state(N - 1)["w"])


def test_a_cache_written_before_the_index_is_listed_right_and_indexed_once(tmp_path: Path,
                                                                           parsed: list[str]) -> None:
    cfg = _disk(tmp_path)
    ids = _save(cfg)
    for seg in _index_files(tmp_path / "disk"):
        seg.unlink()
    (tmp_path / "disk" / "index" / "versions").rmdir()
    (tmp_path / "disk" / "index").rmdir()
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == ids[-1]
        assert len(parsed) == N
        new = cache.save(_state(N), step=N).wait("local")
    parsed.clear()
    assert _listing(cfg) == [*_expected(ids), (new, ids[-1], N, {}, ("disk",))]
    assert parsed == []


def test_a_crash_between_the_manifest_and_its_index_line_loses_nothing(tmp_path: Path, parsed: list[str]) -> None:
    # The third version's commit stops right after its manifest is durable: no index line, no ref
    # (what a kill there leaves on the disk; test_crash.py kills at every failpoint).
    cfg = _disk(tmp_path)
    with tiercache.open(cfg) as cache:
        acked, third = _saves_then_a_crash_after_the_third_manifest(cache, "local")
        with pytest.raises(StorageError):
            cache.close()  # the background error is reported once more on close
    assert (tmp_path / "disk" / "versions" / f"{third.version}.json").exists()
    [seg] = _index_files(tmp_path / "disk")
    assert [json.loads(line)["id"] for line in seg.read_bytes().splitlines()] == acked
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert [(v.id, v.parent, v.step) for v in cache.versions()] == [
            (acked[0], None, 0), (acked[1], acked[0], 1), (third.version, acked[1], 2)]
        assert parsed == [f"disk:versions/{third.version}.json"]  # found by the listing, not the index
        assert cache.resolve("main") == acked[1]  # the ref never moved
        assert torch.equal(cache.restore(third.version)["w"], _state(2)["w"])
    assert [json.loads(line)["id"] for line in seg.read_bytes().splitlines()] == [*acked, third.version]


def test_two_writers_racing_on_one_index_segment_lose_no_version(tmp_path: Path, parsed: list[str]) -> None:
    cfg = _disk(tmp_path)
    with tiercache.open(cfg) as a, tiercache.open(cfg) as b:
        a.versions(), b.versions()  # both read the (empty) index: each appends to what it saw
        va = a.save(_state(0), step=0, branch="a").wait("local")
        vb = b.save(_state(1), step=1, branch="b").wait("local")
    [seg] = _index_files(tmp_path / "disk")
    assert [json.loads(line)["id"] for line in seg.read_bytes().splitlines()] == [vb]  # b overwrote a's line
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert [(v.id, v.branch) for v in cache.versions()] == [(va, "a"), (vb, "b")]
        assert parsed == [f"disk:versions/{va}.json"]
    assert sorted(json.loads(line)["id"] for line in seg.read_bytes().splitlines()) == [va, vb]


def test_versions_gone_from_a_tier_leave_the_listing_though_their_lines_stay(tmp_path: Path,
                                                                            parsed: list[str]) -> None:
    cfg = _disk(tmp_path)
    ids = _save(cfg, n=3)
    with tiercache.open(cfg) as cache:
        cache.rollback("main", ids[0])
        report = cache.gc(grace=0)
    assert sorted(report.versions) == sorted(ids[1:])
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert [v.id for v in cache.versions()] == [ids[0]]
        assert parsed == []


def test_index_segments_roll_over_and_a_rebuild_drops_dead_lines(tmp_path: Path, parsed: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "SEGMENT", 4)
    cfg = _disk(tmp_path)
    ids = _save(cfg, n=10)
    segs = _index_files(tmp_path / "disk")
    assert [len(s.read_bytes().splitlines()) for s in segs] == [4, 4, 2]
    parsed.clear()
    assert _listing(cfg) == _expected(ids[:10])
    assert parsed == []
    with tiercache.open(cfg) as cache:
        cache.rollback("main", ids[0])
        cache.gc(grace=0)
    parsed.clear()
    with tiercache.open(cfg) as cache:  # 9 dead lines, 1 live: rebuilt
        assert [v.id for v in cache.versions()] == [ids[0]]
    assert parsed == []
    assert [[json.loads(line)["id"] for line in s.read_bytes().splitlines()]
            for s in _index_files(tmp_path / "disk")] == [[ids[0]]]


def test_doctor_reindex_rebuilds_every_tier_from_the_manifests(tmp_path: Path, s3_config: S3Config,
                                                                parsed: list[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    cfg = {**_disk(tmp_path), "s3": s3_config.model_dump()}
    ids = _save(cfg, n=3, level="durable")
    [seg] = _index_files(tmp_path / "disk")
    seg.write_bytes(b"junk\n")
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\n\n[s3]\nurl = "{s3_config.url}"\n'
                      f'endpoint_url = "{s3_config.endpoint_url}"\nregion = "{s3_config.region}"\n')
    got = CliRunner().invoke(app, ["--config", str(config), "doctor", "--reindex"])
    assert got.exit_code == 0, got.output
    assert "reindexed disk: 3 versions, 0 pruned" in got.output and "reindexed s3: 3 versions, 0 pruned" in got.output
    assert [json.loads(line)["id"] for line in seg.read_bytes().splitlines()] == ids
    parsed.clear()
    assert _listing(cfg) == _expected(ids, ("disk", "s3"))
    assert parsed == []


def test_s3_alone_lists_from_its_index_and_restores_one_manifest(tmp_path: Path, s3_config: S3Config,
                                                                 parsed: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {**_disk(tmp_path), "s3": s3_config.model_dump()}
    ids = _save(cfg, n=4, level="durable")
    s3_only = {"s3": s3_config.model_dump(), "policy": {"name": "write-through"}}
    parsed.clear()
    assert _listing(s3_only) == _expected(ids, ("s3",))
    assert parsed == []
    listed: list[str] = []
    real_list = S3Tier.list
    monkeypatch.setattr(S3Tier, "list", lambda self, prefix="": listed.append(prefix) or real_list(self, prefix))
    with tiercache.open(s3_only) as cache:
        assert torch.equal(cache.restore("main")["w"], _state(3)["w"])
    assert parsed == [f"s3:versions/{ids[-1]}.json"]
    assert CHUNKS not in listed  # its manifest is there, so are its chunks: no listing of the history's


_VERSION_ON_DISK = 2 * (MIB + 4096) + 8192
_THREE_VERSIONS = 3 * _VERSION_ON_DISK + (MIB + 4096) + 32 * 1024


def test_pruned_records_come_from_the_index_and_stay_visible_without_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {"chunk_bytes": "1MiB", "ram": {"capacity": "32MiB"},
           "disk": {"path": str(tmp_path / "disk"), "capacity": _THREE_VERSIONS},
           "policy": {"name": "throughput-adaptive", "params": {"compression": "off", "retention": {"latest": 1}}}}
    g = torch.Generator().manual_seed(0)
    with tiercache.open(cfg) as cache:
        ids = [cache.save({"w": torch.randn(MIB // 2, generator=g)}, step=i).wait("local") for i in range(5)]
    assert [json.loads(line)["id"] for s in _index_files(tmp_path / "disk", "pruned")
            for line in s.read_bytes().splitlines()] == ids[:2]
    real = PrunedRecord.from_json
    read: list[str] = []
    monkeypatch.setattr(PrunedRecord, "from_json",
                        staticmethod(lambda data, *, source="": read.append(source) or real(data, source=source)))
    for lose_index in (False, True):
        if lose_index:
            for s in _index_files(tmp_path / "disk", "pruned"):
                s.unlink()
        with tiercache.open(cfg) as cache:
            assert [(v.id, v.step, v.parent) for v in cache.pruned()] == [(ids[0], 0, None), (ids[1], 1, ids[0])]
            assert all(v.states["disk"].state == "pruned" for v in cache.pruned())
            assert [v.id for v in cache.versions()] == ids[2:]
        assert read == ([] if not lose_index else [f"disk:pruned/{vid}.json" for vid in ids[:2]])


def test_evictions_stay_visible_from_the_status_index(tmp_path: Path, s3_config: S3Config, _s3_admin: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {**_disk(tmp_path), "s3": s3_config.model_dump()}
    ids = _save(cfg, n=3, level="durable")
    with tiercache.open(cfg) as cache:
        for vid in ids[:2]:
            cache.evict(vid, "disk")
    real = VersionStatus.from_json
    read: list[str] = []
    monkeypatch.setattr(VersionStatus, "from_json",
                        staticmethod(lambda data, *, source="": read.append(source) or real(data, source=source)))

    def states() -> list[tuple[str, str, str]]:
        with tiercache.open(cfg) as cache:
            return [(v.id, v.states["disk"].state, v.states["disk"].reason) for v in cache.versions()]

    evicted = [(vid, "evicted", "evicted by the user") for vid in ids[:2]]
    assert states() == [*evicted, (ids[2], "held", "")]
    assert read == []  # from the index: no status record read
    listing = _s3_admin.list_objects_v2(Bucket=s3_config.bucket, Prefix=f"{s3_config.prefix}/index/status/")
    for obj in listing["Contents"]:
        _s3_admin.delete_object(Bucket=s3_config.bucket, Key=obj["Key"])
    assert states() == [*evicted, (ids[2], "held", "")]
    assert sorted(read) == sorted(f"s3:status/{vid}.json" for vid in ids[:2])  # the records say, once
    read.clear()
    assert states() == [*evicted, (ids[2], "held", "")]
    assert read == []


def _rank_part(vid: str, chunk: str) -> Version:
    entry = TensorEntry(path="w", dtype="uint8", shape=(100,), nbytes=100,
                        pieces=(Piece(chunk=0, chunk_offset=0, offset=0, nbytes=100),))
    return Version(id=vid, parent=None, branch="main", step=1, created_at=utcnow(),
                   chunks=(ChunkRef(id=chunk, nbytes=100),), tensors=(entry,), tree=["dict", {"w": ["t", 0]}],
                   nbytes=100)


def test_a_group_version_lists_from_the_index_and_a_rank_parses_only_its_own_part(tmp_path: Path,
                                                                                   parsed: list[str]) -> None:
    cfg = _disk(tmp_path)
    vid = "01J0000000000000000000000A"
    header = group_header(id=vid, parent=None, branch="main", step=1, created_at=utcnow(), meta={"loss": 0.5},
                          hash_algo="xxh3-128", ranks=2, nbytes=200)
    with tiercache.open(cfg) as cache:
        for rank in range(2):
            core_of(cache).repo.put_part("disk", part_of(_rank_part(vid, f"{rank + 1:032x}"), rank))
        core_of(cache).repo.commit("disk", header, RefRecord(kind="branch", name="main", version=vid, seq=1))
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert [(v.id, v.step, v.meta, v.tiers) for v in cache.versions()] == [(vid, 1, {"loss": 0.5}, ("disk",))]
        assert parsed == []
        got = core_of(cache).catalog.part(core_of(cache).catalog.peek(cache.resolve("main")), 1)
        assert got is not None and [c.id for c in got.chunks] == [f"{2:032x}"]
    assert parsed == [f"disk:versions/{vid}.json", f"disk:parts/{vid}/1.json"]  # never rank 0's part


# S3: as on a disk, every manifest's name is listed at each open and the listing is the truth; the
# index's lines save parsing the manifests (an older tiercache's index has no gone lines, so a line
# alone cannot tell a version is still there).


def _s3_only(s3_config: S3Config) -> dict[str, Any]:
    return {"s3": s3_config.model_dump(), "policy": {"name": "write-through"}, "reflog_keep": 0}


def _s3_lines(admin: Any, s3_config: S3Config) -> list[dict[str, Any]]:
    body = admin.get_object(Bucket=s3_config.bucket, Key=f"{s3_config.prefix}/index/versions/00000000.jsonl")
    return [json.loads(line) for line in body["Body"].read().splitlines()]


def test_s3_a_manifest_without_its_index_line_is_found_by_the_listing(
        s3_config: S3Config, _s3_admin: Any, parsed: list[str]) -> None:
    cfg = _s3_only(s3_config)
    with tiercache.open(cfg) as cache:
        acked, third = _saves_then_a_crash_after_the_third_manifest(cache, "remote")
        with pytest.raises(StorageError):
            cache.close()
    assert [d["id"] for d in _s3_lines(_s3_admin, s3_config)] == acked
    parsed.clear()
    with tiercache.open(cfg) as cache:
        assert [(v.id, v.parent, v.step) for v in cache.versions()] == [
            (acked[0], None, 0), (acked[1], acked[0], 1), (third.version, acked[1], 2)]
        assert parsed == [f"s3:versions/{third.version}.json"]
        assert cache.resolve("main") == acked[1]
        assert torch.equal(cache.restore(third.version)["w"], _state(2)["w"])
    assert [d["id"] for d in _s3_lines(_s3_admin, s3_config)] == [*acked, third.version]


def _drop_line(admin: Any, s3_config: S3Config, vid: str) -> None:
    """Take ``vid``'s lines out of the S3 index (what a racing writer's rewrite of the segment does)."""
    key = f"{s3_config.prefix}/index/versions/00000000.jsonl"
    body = admin.get_object(Bucket=s3_config.bucket, Key=key)["Body"].read()
    admin.put_object(Bucket=s3_config.bucket, Key=key,
                     Body=b"".join(line for line in body.splitlines(keepends=True) if json.loads(line)["id"] != vid))


def test_s3_a_line_lost_to_two_racing_writers_is_found_by_the_listing(
        s3_config: S3Config, _s3_admin: Any, parsed: list[str]) -> None:
    # Two writers appending to one segment: the later rewrite drops the other's line (on disk,
    # test_two_writers_racing_on_one_index_segment_lose_no_version races them for real).
    cfg = _s3_only(s3_config)
    with tiercache.open(cfg) as cache:
        va = cache.save(_state(0), step=0, branch="a").wait("remote")
        vb = cache.save(_state(1), step=1, branch="b").wait("remote")
    _drop_line(_s3_admin, s3_config, va)
    assert [d["id"] for d in _s3_lines(_s3_admin, s3_config)] == [vb]
    parsed.clear()
    with tiercache.open(cfg) as cache:  # va sorts before vb, the index's newest: listed all the same
        assert [(v.id, v.branch) for v in cache.versions()] == [(va, "a"), (vb, "b")]
        assert parsed == [f"s3:versions/{va}.json"]
        assert torch.equal(cache.restore("a")["w"], _state(0)["w"])
    assert sorted(d["id"] for d in _s3_lines(_s3_admin, s3_config)) == [va, vb]


def test_s3_an_older_named_manifest_no_ref_reaches_is_listed_and_its_line_written_back(
        s3_config: S3Config, _s3_admin: Any, parsed: list[str]) -> None:
    # A version committed late under a name older than the index's newest, whose line was lost and
    # that no ref reaches (a slow writer whose index write failed and whose branch was deleted): the
    # open lists it, reads its manifest and writes its line back; a restore by its id and
    # `doctor --reindex` find it as well.
    cfg = _s3_only(s3_config)
    with tiercache.open(cfg) as cache:
        side = cache.save(_state(7), step=7, branch="side").wait("remote")
    with tiercache.open(cfg) as cache:
        main = [cache.save(_state(i), step=i).wait("remote") for i in range(2)]
        assert cache.manifest(main[0]).parent is None
    _s3_admin.delete_object(Bucket=s3_config.bucket, Key=f"{s3_config.prefix}/refs/branch/side")
    for find in ("id", "reindex"):
        _drop_line(_s3_admin, s3_config, side)
        assert [d["id"] for d in _s3_lines(_s3_admin, s3_config)] == main
        parsed.clear()
        with tiercache.open(cfg) as cache:
            assert [(v.id, v.parent, v.step) for v in cache.versions()] == [
                (side, None, 7), (main[0], None, 0), (main[1], main[0], 1)]
            assert parsed == [f"s3:versions/{side}.json"]
            if find == "id":
                assert torch.equal(cache.restore(side)["w"], _state(7)["w"])
            else:
                assert cache.reindex() == {"s3": (3, 0)}
        assert parsed == [f"s3:versions/{side}.json"] if find == "id" else len(parsed) == 4
        assert sorted(d["id"] for d in _s3_lines(_s3_admin, s3_config)) == sorted([side, *main])  # its line is back
        parsed.clear()
        assert [v[0] for v in _listing(cfg)] == [side, *main]
        assert parsed == []


def test_s3_deletions_leave_gone_lines_and_a_manifest_deleted_without_one_is_not_shown(
        s3_config: S3Config, _s3_admin: Any, parsed: list[str]) -> None:
    cfg = _s3_only(s3_config)
    with tiercache.open(cfg) as cache:
        ids = [cache.save(_state(i), step=i).wait("remote") for i in range(4)]
        cache.rollback("main", ids[1])
        assert sorted(cache.gc(grace=0).versions) == ids[2:]
    assert [(d["id"], d.get("gone", False)) for d in _s3_lines(_s3_admin, s3_config)] == [
        *((vid, False) for vid in ids), *((vid, True) for vid in ids[2:])]
    parsed.clear()
    assert [v[0] for v in _listing(cfg)] == ids[:2]
    assert parsed == []
    # A manifest gone without its gone line (what an older tiercache's deletion leaves, or a removal
    # by hand): its line is still in the index, and the listing, not the line, decides.
    _s3_admin.delete_object(Bucket=s3_config.bucket, Key=f"{s3_config.prefix}/versions/{ids[0]}.json")
    lines = _s3_lines(_s3_admin, s3_config)
    with tiercache.open(cfg) as cache:
        assert [(v.id, v.parent, v.tiers) for v in cache.versions()] == [(ids[1], ids[0], ("s3",))]
        with pytest.raises(VersionNotFoundError, match=rf"unknown ref '{ids[0]}': not a branch, tag or version id"):
            cache.restore(ids[0])
        assert torch.equal(cache.restore("main")["w"], _state(1)["w"])
    assert parsed == [f"s3:versions/{ids[1]}.json"]
    assert _s3_lines(_s3_admin, s3_config) == lines
    assert [v[0] for v in _listing(cfg)] == [ids[1]]


def test_a_version_an_older_writer_deleted_from_s3_is_shown_on_the_disk_alone(
        tmp_path: Path, s3_config: S3Config, _s3_admin: Any) -> None:
    # An older tiercache deletes a manifest from S3 and writes no gone line: the disk's copy is then
    # the last one, and residency must say so (else it could be evicted as if S3 still held it).
    cfg = {**_disk(tmp_path), "s3": s3_config.model_dump()}
    ids = _save(cfg, n=2, level="durable")
    assert _listing(cfg) == _expected(ids, ("disk", "s3"))
    _s3_admin.delete_object(Bucket=s3_config.bucket, Key=f"{s3_config.prefix}/versions/{ids[0]}.json")
    assert [d["id"] for d in _s3_lines(_s3_admin, s3_config)] == ids
    assert _listing(cfg) == [_expected(ids, ("disk",))[0], _expected(ids, ("disk", "s3"))[1]]


def test_a_listing_taken_before_a_deletion_never_puts_the_deleted_manifest_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reload (catch-up after an outage) and a first read left behind on a hanging tier list a
    # tier without the catalog's lock and merge afterwards. A deletion that lands in between must
    # stay deleted: a tier shown holding a manifest it lost counts as a copy, and the last real
    # copy could then be evicted.
    with tiercache.open(_disk(tmp_path)) as cache:
        first, second = (cache.save(_state(i), step=i).wait("local") for i in range(2))
        cat = core_of(cache).catalog
        disk = core_of(cache).repo.tiers["disk"]
        real_list = type(disk).list

        def list_then_a_deletion_lands(self: Any, prefix: str = "") -> list[str]:
            keys = real_list(self, prefix)
            if prefix == "versions/":
                cat.mark_on("disk", first, present=False)  # as drop_manifests does, once the listing was taken
            return keys

        monkeypatch.setattr(type(disk), "list", list_then_a_deletion_lands)
        cat.reload("disk")
        assert f"versions/{first}.json" in real_list(disk, "versions/")  # the listing did name it
        assert (cat.manifest_on("disk", first), cat.manifest_on("disk", second)) == (False, True)


def test_a_tier_whose_versions_cannot_be_listed_lends_no_ref(tmp_path: Path, s3_config: S3Config,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # S3's refs, pruned records, reflog and versions are read side by side. S3's head is newer
    # than the disk's; if S3's versions cannot be listed, S3 is down for this process, and its
    # head, a version the catalog does not know, must not become the branch's head here.
    cfg = {**_disk(tmp_path), "s3": s3_config.model_dump()}
    first = _save(cfg, n=1, level="durable")[0]
    newer = _save({"s3": s3_config.model_dump(), "policy": {"name": "write-through"}}, n=1, level="durable")[0]
    real_list = S3Tier.list

    def versions_unlisted(self: S3Tier, prefix: str = "") -> list[str]:
        if prefix == "versions/":
            raise StorageError("versions/ cannot be listed")
        return real_list(self, prefix)

    monkeypatch.setattr(S3Tier, "list", versions_unlisted)
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == first
        assert [v.id for v in cache.versions()] == [first]
        assert core_of(cache).repo.health.available("s3") is False
    monkeypatch.setattr(S3Tier, "list", real_list)
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == newer
        assert cache.manifest("main").parent == first
