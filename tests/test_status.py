"""The status a saving process publishes (stats/status.json), and that a reading process writes nothing."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cache import core_of
from tiercache.cli import app
from tiercache.errors import ConfigError, SkippedError, TierUnavailableError
from tiercache.handle import LEVELS, SaveHandle
from tiercache.runtime import CacheStats
from tiercache.status import RECENT_ERRORS, STATUS_KEY, StatusRecorder, read_status


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Writes:
    """Collects what the recorder writes; ``wait(n)`` blocks until the n-th write."""

    def __init__(self) -> None:
        self.docs: list[dict] = []
        self._cv = threading.Condition()

    def __call__(self, data: bytes) -> None:
        with self._cv:
            self.docs.append(json.loads(data))
            self._cv.notify_all()

    def wait(self, n: int) -> dict:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.docs) >= n, timeout=30), f"no write #{n}"
            return self.docs[n - 1]


def _handle(vid: str) -> tuple[SaveHandle, dict[str, Future[str]]]:
    """A handle as a disk-only cache returns it: no remote level, no replicated level."""
    futures: dict[str, Future[str]] = {lvl: Future() for lvl in LEVELS}
    futures["remote"].set_exception(ConfigError("no s3 tier configured, so no 'remote' level"))
    futures["replicated"].set_exception(ConfigError("no 'replicated' level: it comes with multi-rank saves"))
    return SaveHandle(vid, futures), futures


def test_recorder_writes_what_changed_within_an_interval() -> None:
    writes = Writes()
    rec = StatusRecorder(writes, interval=0.05, meter=lambda: {"tiers": {}, "history": []})
    h1, _ = _handle("01A")
    rec.note_save(h1, step=10, branch="main", started_at=100.0, wait_s=0.25)
    first = writes.wait(1)
    assert first["closed"] is False
    assert first["staged"] == {"version": "01A", "branch": "main", "step": 10, "at": 100.0}
    assert first["queues"] == {"staged": 1, "local": 1, "durable": 1}
    assert first["versions"]["01A"]["levels"]["local"] == {"state": "pending", "at": None, "reason": ""}
    assert "remote" not in first["versions"]["01A"]["levels"]
    rec.close()
    assert writes.wait(2)["closed"] is True


def test_recorder_follows_each_level_and_writes_at_most_once_per_interval() -> None:
    clock, writes = FakeClock(), Writes()
    rec = StatusRecorder(writes, interval=3600.0, meter=lambda: {"tiers": {}, "history": []}, clock=clock)
    h1, f1 = _handle("01A")
    rec.note_save(h1, step=10, branch="main", started_at=100.0, wait_s=0.25)
    clock.t = 101.0
    f1["staged"].set_result("01A")
    clock.t = 103.5
    f1["local"].set_result("01A")
    f1["durable"].set_result("01A")
    h2, f2 = _handle("01B")
    clock.t = 110.0
    rec.note_save(h2, step=20, branch="main", started_at=110.0, wait_s=0.75)
    f2["staged"].set_result("01B")
    f2["local"].set_exception(SkippedError("the policy skipped disk: backlog"))
    f2["durable"].set_exception(TierUnavailableError("disk: device gone"))
    clock.t = 115.0
    rec.note_step(25)

    doc = rec.current().to_json()
    assert writes.docs == []  # nothing written yet: the interval is an hour
    assert doc["levels"] == ["staged", "local", "durable"]
    assert doc["queues"] == {"staged": 0, "local": 0, "durable": 0}
    assert doc["save_wait"]["count"] == 2 and doc["save_wait"]["ewma"] == pytest.approx(0.7 * 0.25 + 0.3 * 0.75)
    assert doc["time_to"]["local"]["recent"] == [[103.5, 3.5]]
    assert doc["newest"]["main"]["local"] == {"version": "01A", "step": 10, "created_at": 100.0, "reached_at": 103.5}
    assert doc["newest"]["main"]["staged"]["version"] == "01B"
    assert doc["training"] == {"main": {"step": 25, "at": 115.0}}
    assert doc["lag"]["main"]["local"] == {"steps": 15, "seconds": 15.0}
    assert doc["lag"]["main"]["staged"] == {"steps": 5, "seconds": 5.0}
    assert doc["versions"]["01B"]["levels"]["local"] == {"state": "skipped", "at": 110.0,
                                                         "reason": "the policy skipped disk: backlog"}
    assert doc["versions"]["01B"]["levels"]["durable"]["state"] == "failed"
    assert [(e["version"], e["level"], e["error"]) for e in doc["errors"]] == [
        ("01B", "durable", "TierUnavailableError")]
    assert doc["lag_history"][-1] == {"t": 115.0, "branch": "main", "step": 25, "levels": doc["lag"]["main"]}

    rec.close()
    final = writes.wait(1)
    assert final["closed"] is True and final["training"] == doc["training"]
    assert len(writes.docs) == 1


def test_errors_are_bounded() -> None:
    rec = StatusRecorder(None, interval=1.0, meter=dict)
    for i in range(RECENT_ERRORS + 5):
        h, f = _handle(f"01{i:03d}")
        rec.note_save(h, step=i, branch="main", started_at=float(i), wait_s=0.0)
        f["local"].set_exception(OSError(f"boom {i}"))
    errors = rec.current().to_json()["errors"]
    assert [e["message"] for e in errors] == [f"boom {i}" for i in range(5, RECENT_ERRORS + 5)]
    rec.close()


def test_a_version_that_failed_is_not_the_training_step_and_errors_name_public_classes() -> None:
    # Issue 47 item 5: the part of a trainer that died failed; lag counts from the last version that did not fail.
    from tiercache.agent.committer import trainer_left
    from tiercache.ui import views

    clock = FakeClock()
    rec = StatusRecorder(None, interval=1.0, meter=lambda: {"tiers": {}, "history": []}, clock=clock, writer="agent")
    h1, f1 = _handle("01A")
    rec.note_save(h1, step=10, branch="main", started_at=100.0, wait_s=0.0)
    for lvl in ("staged", "local", "durable"):
        f1[lvl].set_result("01A")
    h2, f2 = _handle("01B")
    rec.note_save(h2, step=11, branch="main", started_at=105.0, wait_s=0.0)
    assert rec.current().to_json()["training"] == {"main": {"step": 11, "at": 105.0}}
    clock.t = 110.0
    f2["staged"].set_result("01B")
    for lvl in ("local", "durable"):
        f2[lvl].set_exception(trainer_left(4242))
    doc = rec.current().to_json()
    assert doc["writer"] == "agent"
    assert doc["training"] == {"main": {"step": 10, "at": 100.0}}
    assert doc["lag"]["main"]["local"] == {"steps": 0, "seconds": 0.0}
    message = "the trainer (pid 4242) went away before its group committed its part"
    assert doc["errors"] == [
        {"t": 110.0, "version": "01B", "branch": "main", "step": 11, "level": lvl, "error": "AgentUnavailableError",
         "message": message} for lvl in ("local", "durable")]
    assert doc["versions"]["01B"]["levels"]["durable"] == {"state": "failed", "at": 110.0,
                                                           "reason": f"AgentUnavailableError: {message}"}
    cap = views.Capture(at=120.0, tiers=["disk"], levels=["staged", "local", "durable"], policy="write-through",
                        versions=[], refs={}, reflog=[], manifests={}, status=rec.current(), stats=CacheStats(),
                        inputs=None)  # type: ignore[arg-type]
    assert views.throughput(cap)["errors"] == doc["errors"][::-1]
    assert views.lag(cap)["branches"]["main"]["training"] == {"step": 10, "at": 100.0}
    # The advisor's own word on the step stands: it is no version, it cannot fail.
    rec.note_step(12)
    h3, f3 = _handle("01C")
    rec.note_save(h3, step=13, branch="main", started_at=115.0, wait_s=0.0)
    f3["durable"].set_exception(OSError("disk gone"))
    assert rec.current().to_json()["training"] == {"main": {"step": 12, "at": 110.0}}
    rec.close()


def test_a_saving_cache_publishes_its_status_and_a_fresh_process_reads_it(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        ids = [cache.save({"w": torch.full((1024,), float(s))}, step=s).wait("local") for s in range(3)]
        live = cache.status()
        assert live is not None and live["closed"] is False
    doc = read_status((tmp_path / STATUS_KEY).read_bytes())
    assert doc is not None
    stored = doc.to_json()
    assert stored["closed"] is True
    assert list(stored["versions"]) == ids
    assert {lvl: s["state"] for lvl, s in stored["versions"][ids[-1]]["levels"].items()} == {
        "staged": "held", "local": "held", "durable": "held"}
    assert stored["newest"]["main"]["local"]["version"] == ids[-1]
    assert stored["lag"]["main"]["local"]["steps"] == 0
    assert stored["save_wait"]["count"] == 3 and stored["queues"] == {"staged": 0, "local": 0, "durable": 0}
    assert stored["meter"]["tiers"]["disk"]["write"]["transfers"] == len(stored["meter"]["history"]) > 0
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as reader:
        assert reader.status() == stored


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_a_reading_process_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cfg = tmp_path / "tiercache.toml"
    cfg.write_text(f'[disk]\npath = "{root}"\n')
    with tiercache.open(cfg) as cache:
        cache.save({"w": torch.ones(2048)}, step=1).wait("local")
    before = _files(root)
    assert {"stats/status.json", "stats/meter.json"} <= set(before)
    with tiercache.open(cfg) as cache:
        cache.versions(), cache.refs(), cache.status(), cache.stats(), cache.plan_inputs(mttf="3h")
    for verb in (["ls"], ["log", "--graph"], ["stats"], ["plan", "--mttf", "3h"]):
        res = CliRunner().invoke(app, ["--config", str(cfg), *verb])
        assert res.exit_code == 0, res.output
    assert _files(root) == before


def test_runtime_records_go_through_the_repo_and_only_under_stats(tmp_path: Path) -> None:
    """The status and the meter are written by ``Repo.put_record``: nothing else is writable that way."""
    from tiercache.errors import InvalidArgumentError

    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(InvalidArgumentError, match=r"runtime record 'refs/main' must be under stats/"):
            core_of(cache).repo.put_record("refs/main", b"{}")
        assert core_of(cache).repo.put_record("stats/note.json", b'{"a": 1}') is True
        assert core_of(cache).repo.get_record("stats/note.json") == b'{"a": 1}'
    assert (tmp_path / "stats" / "note.json").read_bytes() == b'{"a": 1}'
    assert not (tmp_path / "refs" / "main").exists()
