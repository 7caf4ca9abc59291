"""The storage layer's rules under races: leases against evict and gc, close() against save(),
slow listings against save(), evict against verify, and read-only commands against the bucket.

Races are driven with failpoint hooks (:func:`tiercache.failpoints.hooked`): a thread is held at
a named point in the write or delete path while the other operation runs, so each interleaving
is the one named in the test, not one that timing happened to produce.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from tiercache.errors import CacheClosedError
from tiercache.handle import LEVELS
from tiercache.names import chunk_key

#: How long a held thread or an awaited event may take before the test fails (a liveness bound).
LIVENESS_S = 60.0


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256 * 1024, generator=g), "step": seed}


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want)


def _disk(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"disk": {"path": str(tmp_path / "disk")}, "policy": {"name": "write-through"}, **extra}


def _disk_s3(tmp_path: Path, s3_config: S3Config) -> dict[str, Any]:
    return {**_disk(tmp_path), "s3": s3_config.model_dump()}


class Gate:
    """Holds the thread that hits a failpoint (when ``match`` says so) until :meth:`open`."""

    def __init__(self, match: Callable[..., bool]) -> None:
        self.match = match
        self.arrived = threading.Event()
        self._go = threading.Event()

    def __call__(self, *detail: object) -> None:
        if not self._go.is_set() and self.match(*detail):
            self.arrived.set()
            assert self._go.wait(LIVENESS_S), "the gate was never opened"

    def wait_arrived(self) -> None:
        assert self.arrived.wait(LIVENESS_S), "no thread reached the gate"

    def open(self) -> None:
        self._go.set()


@contextmanager
def _hold(name: str, match: Callable[..., bool]) -> Iterator[Gate]:
    gate = Gate(match)
    with failpoints.hooked(name, gate):
        try:
            yield gate
        finally:
            gate.open()  # never leave a thread held behind a failing assertion


def _dedup_on_disk(tier: str, missing: set[str]) -> bool:
    """A disk writer that found its chunk already stored (it writes nothing and relies on it)."""
    return tier == "disk" and not missing


def _chunks(cache: tiercache.TierCache, vid: str) -> set[str]:
    return {c.id for c in cache.manifest(vid).chunks}


@contextmanager
def _save_while_deleting(cache: tiercache.TierCache, shared: set[str],
                         step: int) -> Iterator[list[tiercache.SaveHandle]]:
    """While the block deletes ``shared`` from the disk: once the deletion has decided on those
    chunks and not yet deleted them, save state 1 (made of them) and hold the deletion until that
    save's claim waits for it. The save's handle is in the yielded list.
    """
    waited = threading.Event()
    handles: list[tiercache.SaveHandle] = []

    def racing_save(tier: str, doomed: set[str]) -> None:
        if tier == "disk" and doomed & shared and not handles:
            handles.append(cache.save(_state(1), step=step))
            assert waited.wait(LIVENESS_S), "the save's claim did not wait for the deletion"

    with failpoints.hooked("leases.claim_waits", lambda tier, ids: waited.set()), \
            failpoints.hooked("repo.chunks_doomed", racing_save):
        yield handles


def _restores_from_disk_alone(tmp_path: Path, vid: str, want: dict[str, Any]) -> None:
    """Reopened on the disk alone (no RAM, no S3): the version restores bit-exact and verify is clean."""
    with tiercache.open({"disk": {"path": str(tmp_path / "disk")}}) as cache:
        assert _equal(cache.restore(vid), want)
        report = cache.verify()
        assert (report.damage, report.unrepairable) == ((), ())


# ---------------------------------------------------------------------- evict then verify


def test_evict_then_verify_reports_nothing_and_ls_agrees_after_reopening(tmp_path: Path,
                                                                         s3_config: S3Config) -> None:
    cfg = _disk_s3(tmp_path, s3_config)
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
        v2 = cache.save(_state(2), step=2).wait("remote")
        cache.evict(v1, "disk")
        report = cache.verify()
        assert (report.versions, report.damage, report.unrepairable) == (2, (), ())
        repaired = cache.verify(repair=True)
        assert (repaired.damage, repaired.repaired) == ((), 0)
        assert not any((tmp_path / "disk" / chunk_key(c)).exists() for c in _chunks(cache, v1))
        assert not (tmp_path / "disk" / "versions" / f"{v1}.json").exists()
        assert {v.id: v.tiers for v in cache.versions()} == {v1: ("s3",), v2: ("disk", "s3")}
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\n\n[s3]\nurl = "{s3_config.url}"\n'
                      f'endpoint_url = "{s3_config.endpoint_url}"\nregion = "{s3_config.region}"\n')
    listed = CliRunner().invoke(app, ["--config", str(config), "ls", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {r["id"]: r["tiers"] for r in json.loads(listed.stdout)} == {v1: ["s3"], v2: ["disk", "s3"]}
    verified = CliRunner().invoke(app, ["--config", str(config), "verify", "--json"])
    assert (verified.exit_code, json.loads(verified.stdout)["damage"]) == (0, [])


# ---------------------------------------------------------------------- leases against evict


def test_evict_keeps_a_chunk_a_pending_save_found_stored(tmp_path: Path, s3_config: S3Config) -> None:
    with tiercache.open(_disk_s3(tmp_path, s3_config)) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
        cache.save(_state(2), step=2).wait("remote")
        shared = _chunks(cache, v1)
        with _hold("repo.after_claim", _dedup_on_disk) as gate:
            h3 = cache.save(_state(1), step=3)  # the same bytes as v1: deduplicated on disk
            gate.wait_arrived()  # v3 leased v1's chunk on disk and will not write it
            cache.evict(v1, "disk")
            assert all((tmp_path / "disk" / chunk_key(c)).exists() for c in shared)  # leased: kept
            gate.open()
            v3 = h3.wait("remote")
        assert _chunks(cache, v3) == shared
        assert "disk" not in {v.id: v.tiers for v in cache.versions()}[v1]
    _restores_from_disk_alone(tmp_path, v3, _state(1))


def test_a_save_that_asks_for_a_chunk_being_evicted_waits_and_writes_it_again(tmp_path: Path,
                                                                              s3_config: S3Config) -> None:
    with tiercache.open(_disk_s3(tmp_path, s3_config)) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
        cache.save(_state(2), step=2).wait("remote")
        shared = _chunks(cache, v1)
        with _save_while_deleting(cache, shared, step=3) as handles:
            cache.evict(v1, "disk")
            v3 = handles[0].wait("remote")
        assert _chunks(cache, v3) == shared
    _restores_from_disk_alone(tmp_path, v3, _state(1))


# ---------------------------------------------------------------------- leases against gc


def _orphan(cache: tiercache.TierCache) -> tuple[str, str]:
    """v0 on main, then v1 (state 1) rolled back: v1 and its chunk are garbage once gc runs."""
    v0 = cache.save(_state(0), step=0).wait("local")
    v1 = cache.save(_state(1), step=1).wait("local")
    cache.rollback("main", v0)
    return v0, v1


def test_gc_keeps_a_chunk_a_save_started_meanwhile_found_stored(tmp_path: Path) -> None:
    handles: list[tiercache.SaveHandle] = []
    with tiercache.open(_disk(tmp_path, reflog_keep=0)) as cache:
        v0, v1 = _orphan(cache)
        shared = _chunks(cache, v1)
        with _hold("repo.after_claim", _dedup_on_disk) as gate:

            def save_meanwhile() -> None:
                # gc has decided what lives (v2 did not exist yet) and not yet deleted chunks.
                handles.append(cache.save(_state(1), step=2))
                gate.wait_arrived()  # v2 leased v1's chunk on disk and will not write it

            with failpoints.hooked("gc.after_manifest_delete", save_meanwhile):
                report = cache.gc(grace=0)
            assert report.versions == (v1,) and report.chunks["disk"] == 0
            assert all((tmp_path / "disk" / chunk_key(c)).exists() for c in shared)
            gate.open()
            v2 = handles[0].wait("local")
        assert cache.manifest(v2).parent == v0 and _chunks(cache, v2) == shared
    _restores_from_disk_alone(tmp_path, v2, _state(1))


def test_gc_keeps_a_chunk_named_by_a_version_committed_while_it_ran(tmp_path: Path) -> None:
    handles: list[tiercache.SaveHandle] = []
    with tiercache.open(_disk(tmp_path, reflog_keep=0)) as cache:
        _, v1 = _orphan(cache)

        def commit_meanwhile() -> None:
            # A save starts after gc decided what lives and is committed (its lease over) before
            # gc deletes chunks: its manifest must keep the chunk it found stored.
            handles.append(cache.save(_state(1), step=2))
            handles[0].wait("local")

        with failpoints.hooked("gc.after_manifest_delete", commit_meanwhile):
            report = cache.gc(grace=0)
        assert report.versions == (v1,) and report.chunks["disk"] == 0
        v2 = handles[0].version
    _restores_from_disk_alone(tmp_path, v2, _state(1))


def test_a_save_that_asks_for_a_chunk_gc_is_deleting_waits_and_writes_it_again(tmp_path: Path) -> None:
    with tiercache.open(_disk(tmp_path, reflog_keep=0)) as cache:
        _, v1 = _orphan(cache)
        shared = _chunks(cache, v1)
        with _save_while_deleting(cache, shared, step=2) as handles:
            report = cache.gc(grace=0)
        assert report.versions == (v1,) and report.chunks["disk"] == len(shared)
        v2 = handles[0].wait("local")
    _restores_from_disk_alone(tmp_path, v2, _state(1))


def test_a_pending_save_outlives_a_rollback_gc_and_ram_eviction_meanwhile(tmp_path: Path) -> None:
    with tiercache.open(_disk(tmp_path, reflog_keep=0)) as cache:
        v0 = cache.save(_state(0), step=0).wait("local")
        v1 = cache.save(_state(2), step=1).wait("local")
        vx = cache.save(_state(1), step=1, branch="x").wait("local")  # state 1's chunk, soon an orphan's
        cache.rollback("x", v0)
        with _hold("repo.after_claim", _dedup_on_disk) as gate:
            h2 = cache.save(_state(1), step=2)
            gate.wait_arrived()  # the disk writer leased state 1's chunk, found it stored, relies on it
            assert cache.rollback("main", v0) == v0
            report = cache.gc(grace=0)
            cache.evict(h2.version, "ram")
            gate.open()
            assert h2.wait("local") == h2.version
        # gc took the orphan's manifest but not the chunk h2 had leased, nor h2's parent v1.
        assert (report.versions, report.chunks["disk"]) == ((vx,), 0)
        assert cache.refs() == {"branch/main": v0, "branch/x": v0}  # the rollback stands
        assert {v.id: v.parent for v in cache.versions()} == {v0: None, v1: v0, h2.version: v1}
    _restores_from_disk_alone(tmp_path, h2.version, _state(1))
    with tiercache.open(_disk(tmp_path, reflog_keep=0)) as cache:  # now off every branch: garbage
        assert sorted(cache.gc(grace=0).versions) == sorted([v1, h2.version])


# ---------------------------------------------------------------------- close() against save()


@pytest.mark.parametrize("after", [0, 1, 3, 6])
def test_close_racing_save_settles_every_handle(tmp_path: Path, after: int) -> None:
    cache = tiercache.open(_disk(tmp_path))
    handles: list[tiercache.SaveHandle] = []
    refused: list[BaseException] = []
    started = threading.Event()

    def trainer() -> None:
        step = 0
        while True:
            try:
                handles.append(cache.save(_state(step), step=step))
            except CacheClosedError as e:
                refused.append(e)
                return
            step += 1
            if step > after:
                started.set()

    t = threading.Thread(target=trainer)
    t.start()
    assert started.wait(LIVENESS_S)
    cache.close()
    t.join(LIVENESS_S)
    assert not t.is_alive()
    assert len(refused) == 1 and "closed" in str(refused[0])
    assert all(h.done(level) for h in handles for level in LEVELS)  # settled: close() waited for them
    local = [h.version for h in handles if h.succeeded("local")]
    assert local == [h.version for h in handles]  # nothing refused the disk: every one is there
    with tiercache.open({"disk": {"path": str(tmp_path / "disk")}}) as again:
        for step, h in enumerate(handles):
            assert _equal(again.restore(h.version), _state(step))


# ---------------------------------------------------------------------- slow listings


def test_a_blocked_s3_listing_never_delays_save(tmp_path: Path, s3_config: S3Config) -> None:
    listing = threading.Event()
    release = threading.Event()
    listed = threading.Event()
    with tiercache.open(_disk_s3(tmp_path, s3_config)) as cache:
        s3 = core_of(cache).repo.tiers["s3"]
        real_list = s3.list

        def slow_list(prefix: str = "") -> list[str]:
            if prefix.startswith("chunks"):
                listing.set()
                release.wait(LIVENESS_S)
                listed.set()
            return real_list(prefix)

        s3.list = slow_list  # type: ignore[method-assign]
        try:
            h1 = cache.save(_state(1), step=1)
            assert listing.wait(LIVENESS_S)  # the S3 writer is listing the bucket's chunks, blocked
            h2 = cache.save(_state(2), step=2)
            assert h2.wait("local") and h1.wait("local")
            assert not listed.is_set() and not h1.done("remote")  # all that while the listing was held
        finally:
            release.set()
        assert (h1.wait("remote"), h2.wait("remote")) == (h1.version, h2.version)


# ---------------------------------------------------------------------- read-only commands


READ_ONLY = [["ls"], ["ls", "--json"], ["log"], ["log", "--reflog"], ["verify"], ["stats"], ["doctor"],
             ["plan", "--mttf", "3h"]]


def test_read_only_commands_send_no_write_to_the_bucket(tmp_path: Path, s3_config: S3Config,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.httpsession

    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\n\n[s3]\nurl = "{s3_config.url}"\n'
                      f'endpoint_url = "{s3_config.endpoint_url}"\nregion = "{s3_config.region}"\n')
    with tiercache.open(config) as cache:
        for step in range(2):
            cache.save(_state(step), step=step).wait("remote")
    sent: list[tuple[str, str]] = []
    real_send = botocore.httpsession.URLLib3Session.send

    def counting_send(self: Any, request: Any) -> Any:
        sent.append((request.method, request.url))
        return real_send(self, request)

    monkeypatch.setattr(botocore.httpsession.URLLib3Session, "send", counting_send)
    for args in READ_ONLY:
        got = CliRunner().invoke(app, ["--config", str(config), *args])
        assert got.exit_code == 0, (args, got.output)
    assert sent, "the commands read nothing from the bucket"
    assert [(m, u) for m, u in sent if m not in ("GET", "HEAD")] == []


# ---------------------------------------------------------------------- write order on disk


@contextmanager
def _disk_events(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[list[tuple[str, str]]]:
    """Record directory fsyncs and renames into place (``sync``/``put``, path relative to ``root``)."""
    import tiercache.tiers.disk as diskmod

    events: list[tuple[str, str]] = []
    real_sync, real_put = diskmod._fsync_dir, diskmod.PendingPut.commit_path

    def fsync_dir(path: str) -> None:
        real_sync(path)
        events.append(("sync", os.path.relpath(path, root)))

    def commit_path(self: diskmod.PendingPut, path: str, key: str) -> None:
        # The rename, then (inside) the directory's fsync when the put syncs its name.
        events.append(("put", key))
        real_put(self, path, key)

    monkeypatch.setattr(diskmod, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(diskmod.PendingPut, "commit_path", commit_path)
    yield events
    monkeypatch.undo()


def _version_events(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Leave out the saving process's status files (stats/, status/): written on their own schedule."""
    return [(op, p) for op, p in events if not p.startswith(("stats", "status"))]


def test_a_commit_syncs_chunk_names_then_writes_and_syncs_the_manifest_then_the_ref(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "disk"
    cfg = {**_disk(tmp_path), "chunk_bytes": "256KiB"}
    with _disk_events(monkeypatch, root) as events, tiercache.open(cfg) as cache:
        vid = cache.save({"a": torch.randn(1 << 18), "b": torch.randn(1 << 17)}, step=1).wait("local")
        chunks = {c.id for c in cache.manifest(vid).chunks}
        chunk_dirs = {f"chunks/{c[:2]}" for c in chunks}
    got = _version_events(events)
    manifest = got.index(("put", f"versions/{vid}.json"))
    ref = got.index(("put", "refs/branch/main"))
    chunk_puts = [i for i, (op, p) in enumerate(got) if op == "put" and p.startswith("chunks/")]
    assert sorted(got[i][1] for i in chunk_puts) == sorted(chunk_key(c) for c in chunks) and len(chunks) > 2
    # Chunks, then each chunk directory synced once (the root's chunks/ too where it is new),
    # then the manifest and its directory, then the ref and its directory.
    between = got[max(chunk_puts) + 1:manifest]
    assert {p for op, p in between if op == "sync"} >= chunk_dirs
    assert all(op == "sync" for op, _ in between)
    assert got[manifest + 1] == ("sync", "versions")
    assert manifest < ref and got[ref + 1] == ("sync", "refs/branch")


def test_a_chunk_found_stored_is_synced_before_a_manifest_names_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "disk"
    with tiercache.open(_disk(tmp_path)) as cache:  # an earlier process: it may have died before syncing
        v1 = cache.save(_state(1), step=1).wait("local")
        chunk_dirs = {f"chunks/{c.id[:2]}" for c in cache.manifest(v1).chunks}
    with _disk_events(monkeypatch, root) as events, tiercache.open(_disk(tmp_path)) as cache:
        v2 = cache.save(_state(1), step=2).wait("local")  # deduplicated: found by listing, not written
    got = _version_events(events)
    manifest = got.index(("put", f"versions/{v2}.json"))
    assert not any(op == "put" and p.startswith("chunks/") for op, p in got)
    assert {p for op, p in got[:manifest] if op == "sync"} >= chunk_dirs
