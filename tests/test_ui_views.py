"""What tiercache ui shows, as data: lineage, residency (VersionInfo.states, refined by the saving
process's status), reflog (TierCache.reflog), manifest summaries, durability lag, throughput and advice."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.manifest import TierState
from tiercache.runtime import Status
from tiercache.ui import views

KIB = 1024


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(16 * KIB, generator=g) for k in ("a", "b", "c")}  # 64 KiB each: one chunk each


@pytest.fixture
def history(tmp_path: Path) -> tuple[dict[str, Any], list[str]]:
    """main: s1 <- s2 (b changed) <- s3 (rolled back); ft branched at s1 with one save; tag best at s2."""
    cfg = {"disk": {"path": str(tmp_path)}, "chunk_bytes": "64KiB", "pack_below": "4KiB"}
    s1 = _state(1)
    s2 = dict(s1, b=s1["b"] * 2)
    with tiercache.open(cfg) as cache:
        ids = [cache.save(s1, step=1, meta={"loss": 1.5}).wait("local"),
               cache.save(s2, step=2).wait("local"),
               cache.save(_state(3), step=3).wait("local")]
        cache.rollback("main", ids[1])
        cache.branch("ft", ids[0])
        ids.append(cache.save(_state(4), step=5, branch="ft").wait("local"))
        cache.tag("best", ids[1])
    return cfg, ids


def _capture(cache: Any, mttf: float | None = 10800.0) -> views.Capture:
    return views.Capture.of(cache, mttf=mttf, now=datetime.now(UTC).timestamp())


def test_lineage_draws_branches_tags_rollbacks_and_the_reflog(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, ids = history
    with tiercache.open(cfg) as cache:
        cap = _capture(cache)
    lin = views.lineage(cap)
    assert [v["id"] for v in lin["versions"]] == ids[::-1]
    assert [(v["branch"], v["step"], v["rolled_back"]) for v in lin["versions"]] == [
        ("ft", 5, False), ("main", 3, True), ("main", 2, False), ("main", 1, False)]
    assert lin["versions"][2]["refs"] == ["branch/main", "tag/best"]
    assert lin["versions"][3]["meta"] == {"loss": 1.5} and lin["versions"][3]["short"] == ids[0][:10]
    assert lin["branches"] == [{"name": "ft", "head": ids[3], "step": 5, "versions": 1},
                               {"name": "main", "head": ids[1], "step": 2, "versions": 3}]
    assert lin["tags"] == [{"name": "best", "version": ids[1]}]
    assert {t: s["state"] for t, s in lin["versions"][0]["states"].items()} == {"disk": "held"}
    # Newest first: the tag, the save that started ft (from main@1: the branch move), the rollback,
    # then the saves of main.
    assert [(m["why"], m["name"], m["version"], m["previous"]) for m in lin["reflog"]] == [
        ("tag", "best", ids[1], None), ("save", "ft", ids[3], ids[0]), ("branch", "ft", ids[0], None),
        ("rollback", "main", ids[1], ids[2]), ("save", "main", ids[2], ids[1]), ("save", "main", ids[1], ids[0]),
        ("save", "main", ids[0], None)]
    assert all(m["at"] is not None for m in lin["reflog"])


def test_states_say_why_a_tier_lacks_a_version(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, ids = history
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with tiercache.open(cfg) as cache:
        info = next(v for v in cache.versions() if v.id == ids[2])
    info = dataclasses.replace(info, states={"disk": TierState("held"),
                                             "s3": TierState("skipped", "coalesced: newer version pending", at)})
    got = views.tier_states(info, ["disk", "s3"], None)
    assert got == {"disk": {"state": "held", "reason": "", "at": None},
                   "s3": {"state": "skipped", "reason": "coalesced: newer version pending", "at": at.timestamp()}}


def test_states_merge_what_the_saving_process_recorded(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, ids = history
    with tiercache.open(cfg) as cache:
        info = next(v for v in cache.versions() if v.id == ids[0])
    status = Status.model_validate({"closed": False, "pid": 42, "versions": {ids[0]: {
        "branch": "main", "step": 1, "created_at": 1.0, "levels": {
            "staged": {"state": "held", "at": 5.0, "reason": ""},
            "remote": {"state": "failed", "at": 7.0, "reason": "TierUnavailableError: s3 down"}}}}})
    info = dataclasses.replace(info, states={**info.states, "s3": TierState("absent")})
    got = views.tier_states(info, ["ram", "disk", "s3"], status)
    assert got["ram"]["state"] == "held" and "pid 42" in got["ram"]["reason"]
    assert got["disk"] == {"state": "held", "reason": "", "at": None}
    # This viewer's "absent" gives way to the saving process's "failed", with its reason.
    assert got["s3"] == {"state": "failed", "reason": "TierUnavailableError: s3 down", "at": 7.0}
    closed = views.tier_states(info, ["ram"], status.model_copy(update={"closed": True}))
    assert closed["ram"] == {"state": "absent", "reason": "the saving process has closed: its RAM arena is gone",
                             "at": None}


def test_version_summary_counts_dedup_against_the_parent(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, ids = history
    with tiercache.open(cfg) as cache:
        cap = _capture(cache)
    first = views.version_summary(cap, ids[0])
    second = views.version_summary(cap, ids[1])
    assert first is not None and second is not None
    assert first["dedup"]["parent"] is None and first["dedup"]["new_chunks"] == 3
    assert (second["tensors"], second["chunks"], second["unique_chunks"]) == (3, 3, 3)
    assert second["dedup"] == {"parent": ids[0], "parent_known": True, "shared_chunks": 2,
                               "shared_bytes": 2 * 64 * KIB, "new_chunks": 1, "new_bytes": 64 * KIB,
                               "ratio": pytest.approx(2 / 3)}
    assert second["refs"] == ["branch/main", "tag/best"] and second["nbytes"] == 3 * 64 * KIB
    assert views.version_summary(cap, "01NOPE") is None


def test_lag_from_status_and_catalog(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, ids = history
    with tiercache.open(cfg) as cache:
        cap = _capture(cache)
    # The saving process said training reached step 9 at t = created(step 2) + 60 s, and that
    # version 2 reached local.
    v2 = next(v for v in cap.versions if v.id == ids[1])
    created = v2.created_at.timestamp()
    status = {"levels": ["staged", "local", "durable"], "training": {"main": {"step": 9, "at": created + 60.0}},
              "newest": {"main": {"local": {"version": ids[1], "step": 2, "created_at": created, "reached_at": 1.0}}},
              "lag_history": [{"t": 1.0, "branch": "main", "step": 9, "levels": {}}]}
    got = views.lag(dataclasses.replace(cap, status=Status.model_validate(status)))
    assert got["levels"] == ["staged", "local", "durable"]
    main = got["branches"]["main"]
    assert main["training"] == {"step": 9, "at": created + 60.0} and main["training_source"] == "status"
    # The disk also lists step 3, but main was rolled back past it: no resume point for main.
    assert main["levels"]["local"]["version"] == ids[1] and main["levels"]["local"]["steps"] == 7
    assert main["levels"]["durable"]["version"] == ids[1] and main["levels"]["durable"]["seconds"] == 60.0
    assert main["levels"]["staged"] is None
    ft = got["branches"]["ft"]
    assert ft["training_source"] == "catalog" and ft["levels"]["durable"]["steps"] == 0
    assert got["history"] == status["lag_history"]


def test_throughput_and_advice(history: tuple[dict[str, Any], list[str]]) -> None:
    cfg, _ = history
    with tiercache.open(cfg) as cache:
        cap = _capture(cache)
    th = views.throughput(cap)
    assert th["source"] == "status"  # the saving process left its meter in its status
    assert all(h["bps"] == h["bytes"] / h["seconds"] for h in th["history"] if h["seconds"] > 0)
    assert th["queues"] == {"staged": 0, "local": 0, "durable": 0} and th["errors"] == []
    adv = views.advice(cap)
    assert adv["source"] == "measured" and adv["plan"]["inputs"]["mttf"]["seconds"] == 10800.0
    assert cap.status is not None
    trainer = dataclasses.replace(cap, status=cap.status.model_copy(update={
        "closed": False, "advice": {"interval_s": 99.0, "inputs": {"level": "local"}}}))
    assert views.advice(trainer) == {"source": "trainer", "plan": {"interval_s": 99.0, "inputs": {"level": "local"}},
                                     "reason": None, "inputs": {"level": "local"}}
    with tiercache.open(cfg) as cache:
        no_mttf = _capture(cache, mttf=None)
    got = views.advice(no_mttf)
    assert got["plan"] is None and "without mttf" in got["reason"]
    ov = views.overview(cap, refresh=2.0)
    assert (ov["versions"], ov["branches"], ov["tags"], ov["tiers"]) == (4, 2, 1, ["disk"])
    assert ov["trainer"]["closed"] is True and ov["refresh_s"] == 2.0


def test_a_rollback_that_later_saves_built_on_shows_in_the_reflog(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        a, b = (cache.save({"w": torch.full((8,), float(s))}, step=s).wait("local") for s in (1, 2))
        cache.rollback("main", a)
        c = cache.save({"w": torch.zeros(8)}, step=3).wait("local")
        cap = _capture(cache)
    moves = [(m["why"], m["version"], m["previous"]) for m in views.lineage(cap)["reflog"]]
    assert moves == [("save", c, a), ("rollback", a, b), ("save", b, a), ("save", a, None)]
    assert [v["rolled_back"] for v in views.lineage(cap)["versions"]] == [False, True, False]
