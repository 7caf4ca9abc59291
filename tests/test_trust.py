"""The trust guarantees under the default config: every version durable, no lineage holes, truthful resume.

Disk plus the real local S3 server, the default ``throughput-adaptive`` policy, bursts of saves of
small, large and mixed states, then a fresh process's view: every version the trainer saved is on
at least one durable tier, every parent exists, ``NAME~N``/``NAME@STEP`` walk the whole history and
``gc`` collects nothing of a branch that was never rolled back. Resuming from an older step (the
plain API in a fresh process; Lightning and Hugging Face in their own tests) moves the branch
truthfully and keeps what it left behind in the reflog.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache import failpoints
from tiercache.cli import app
from tiercache.config import S3Config
from tiercache.errors import StateMismatchError
from tiercache.policy.base import Placement, PolicyContext, TierPlan, VersionView

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _state(step: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(nbytes // 4, generator=g), "step": step}


def _config(tmp_path: Path, s3_config: S3Config, **extra: Any) -> dict[str, Any]:
    return {"disk": {"path": str(tmp_path / "disk")}, "s3": s3_config.model_dump(), **extra}


def _check_lineage(cache: tiercache.TierCache, saved: list[str], sizes: list[int]) -> None:
    """Every saved version is durable somewhere, its parent is the one saved before, and history is whole."""
    infos = {v.id: v for v in cache.versions()}
    assert sorted(infos) == sorted(saved)
    for i, vid in enumerate(saved):
        info = infos[vid]
        assert {"disk", "s3"} & set(info.tiers), (vid, info.states)
        assert info.parent == (saved[i - 1] if i else None)
        for name, st in info.states.items():
            assert st.state in ("held", "skipped"), (vid, name, st)
    n = len(saved)
    assert cache.resolve("main") == saved[-1]
    assert cache.resolve(f"main~{n - 1}") == saved[0]
    assert [cache.resolve(f"main@{i}") for i in range(n)] == saved
    for i in (0, n // 2, n - 1):
        got = cache.restore(saved[i])
        assert torch.equal(got["w"], _state(i, sizes[i])["w"]) and got["step"] == i


@pytest.mark.parametrize("kind", ["small", "large", "mixed"])
def test_the_default_policy_leaves_no_version_on_no_tier(tmp_path: Path, s3_config: S3Config, kind: str) -> None:
    sizes = {"small": [1 * MIB] * 20, "large": [24 * MIB] * 5,
             "mixed": [1 * MIB, 24 * MIB, 256 * 1024, 1 * MIB, 8 * MIB, 64 * 1024] * 2}[kind]
    cfg = _config(tmp_path, s3_config)
    with tiercache.open(cfg) as cache:
        handles = [cache.save(_state(i, n), step=i) for i, n in enumerate(sizes)]  # back to back
        cache.flush()  # raises if any version reached no durable tier
        assert [h.wait("durable") for h in handles] == [h.version for h in handles]
        assert cache.stats()["errors"]["lost_versions"] == 0
    saved = [h.version for h in handles]
    with tiercache.open(cfg) as fresh:  # what a restarted process sees
        _check_lineage(fresh, saved, sizes)
        report = fresh.gc(grace=0)
        assert report.versions == () and report.total_bytes == 0  # an un-rolled-back branch keeps its history
        assert [v.id for v in fresh.versions()] == saved


class _SkipsEverything:
    """A careless policy: every tier is skipped for every version."""

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        return Placement(tuple(TierPlan(t, skip=True, reason="careless policy") for t in ctx.tiers if t != "ram"))

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        return []

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> str:
        return "wait"


def test_the_engine_overrides_a_policy_that_places_a_version_nowhere(tmp_path: Path) -> None:
    cfg = {"disk": {"path": str(tmp_path)}, "policy": {"name": f"{__name__}:_SkipsEverything"}}
    with tiercache.open(cfg) as cache:
        hs = [cache.save(_state(i, 64 * 1024), step=i) for i in range(3)]
        assert [h.wait("local") for h in hs] == [h.version for h in hs]
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as fresh:
        assert [(v.step, v.parent) for v in fresh.versions()] == [(0, None), (1, hs[0].version), (2, hs[1].version)]


def test_on_full_skip_still_drops_versions_and_their_children_name_a_durable_parent(tmp_path: Path) -> None:
    # The explicit way to drop versions stays: a 1-version arena and on_full="skip". The disk
    # writer is held after its first claim, so the arena is full after the first save for sure:
    # the five saves after it are dropped, and the next save once there is room names the kept one.
    cfg = {"disk": {"path": str(tmp_path)}, "ram": {"capacity": "1MiB"},
           "policy": {"name": "write-through", "params": {"on_full": "skip"}}}
    go = threading.Event()
    with tiercache.open(cfg) as cache:
        with failpoints.hooked("repo.after_claim", lambda tier, missing: go.wait(60)):
            hs = [cache.save(_state(i, 512 * 1024), step=i) for i in range(6)]
            go.set()
        errors = [h.future("staged").exception() for h in hs]
        kept = [h.wait("local") for h, e in zip(hs, errors, strict=True) if e is None]
        assert [hs[0].version] == kept
        assert all("policy said skip" in str(e) for e in errors[1:])
        h6 = cache.save(_state(6, 512 * 1024), step=6)  # the arena has room again
        kept.append(h6.wait("local"))
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as fresh:
        assert [(v.id, v.parent) for v in fresh.versions()] == [(kept[0], None), (kept[1], kept[0])]


# ----------------------------------------------------------------------------- resume


def test_resuming_from_an_older_step_in_a_fresh_process_moves_the_branch_truthfully(tmp_path: Path) -> None:
    cfg = {"disk": {"path": str(tmp_path)}, "gc_grace": 0}
    with tiercache.open(cfg) as first:
        v = {s: first.save(_state(s, 4096), step=s).wait("local") for s in (10, 20, 30)}
    # A loss spike: a fresh process goes back to step 10 and trains on.
    script = (
        "import json, sys, torch, tiercache\n"
        "from tests.test_trust import _state\n"
        "with tiercache.open(json.loads(sys.argv[1])) as cache:\n"
        "    assert cache.restore('main@10')['step'] == 10\n"
        "    print(cache.save(_state(15, 4096), step=15).wait('local'))\n"
        "    print(cache.save(_state(21, 4096), step=20).wait('local'))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True,
                         check=False, cwd=ROOT, timeout=120)
    assert ran.returncode == 0, ran.stderr
    w15, w20 = ran.stdout.split()
    with tiercache.open(cfg) as fresh:
        m = {x.id: x for x in fresh.versions()}
        assert m[w15].parent == v[10] and m[w20].parent == w15
        assert fresh.refs()["branch/main"] == w20
        # The current history wins: main@20 is the new step 20, main~2 is step 10.
        assert fresh.resolve("main@20") == w20 and fresh.resolve("main@15") == w15
        assert [fresh.resolve(f"main~{i}") for i in range(3)] == [w20, w15, v[10]]
        assert fresh.restore("main@20")["step"] == 21
        # The versions left behind stay reachable: the reflog names them, and gc keeps them.
        resume = [m for m in fresh.reflog("main") if m.why == "resume"]
        assert [(r.version, r.previous) for r in resume] == [(w15, v[30])]
        assert fresh.gc(grace=0).versions == ()
        assert fresh.restore(v[30])["step"] == 30
    toml = tmp_path / "tiercache.toml"
    toml.write_text(f'[disk]\npath = "{tmp_path}"\n')
    shown = CliRunner().invoke(app, ["--config", str(toml), "log", "--reflog", "main"])
    assert shown.exit_code == 0, shown.output
    assert [line.split()[2:] for line in shown.stdout.splitlines()] == [
        ["branch/main", "save", w20[:10]], ["branch/main", "resume", w15[:10], "(was", f"{v[30][:10]})"],
        ["branch/main", "save", v[30][:10]], ["branch/main", "save", v[20][:10]], ["branch/main", "save", v[10][:10]]]


def test_restoring_the_head_continues_the_branch_and_a_new_branch_starts_from_what_was_restored(
    tmp_path: Path,
) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        a = cache.save(_state(1, 4096), step=1).wait("local")
        b = cache.save(_state(2, 4096), step=2).wait("local")
        cache.restore("main")  # the head: nothing to resume from
        c = cache.save(_state(3, 4096), step=3).wait("local")
        cache.restore("main@1")
        ft = cache.save(_state(4, 4096), step=4, branch="ft").wait("local")
        assert [(x.id, x.parent) for x in cache.versions()] == [(a, None), (b, a), (c, b), (ft, a)]
        assert [m.why for m in cache.reflog("ft")] == ["branch"]
        # main was not saved on since the restore: its head is unchanged.
        assert cache.refs()["branch/main"] == c


# ----------------------------------------------------------------------------- restore(into=)


def test_restore_into_that_matches_nothing_names_the_keys_and_the_fix(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        cache.save({"model": model.state_dict(), "epoch": 3}, step=1).wait("local")
        fresh = torch.nn.Linear(4, 2)
        before = {k: t.clone() for k, t in fresh.state_dict().items()}
        with pytest.raises(StateMismatchError) as e:
            cache.restore("main", into=fresh.state_dict())
        assert str(e.value) == (
            f"restore into: 2 tensor(s) of into match nothing in version {cache.resolve('main')}: 'weight', "
            "'bias'; the version's unmatched tensors are 'model/weight', 'model/bias'; they are the version's keys "
            "under 'model/': pass into={'model': ...}; nothing was read (pass strict=False to fill only what "
            "matches)"
        )
        assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)  # untouched
        state = cache.restore("main", into={"model": fresh.state_dict()})
        assert torch.equal(fresh.weight, model.weight) and state["epoch"] == 3


def test_restore_into_with_another_shape_is_refused_and_strict_false_fills_what_matches(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        saved = {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)}
        cache.save(saved, step=1).wait("local")
        into = {"a": torch.zeros(6), "b": torch.zeros(4, dtype=torch.int64), "extra": torch.zeros(2)}
        with pytest.raises(StateMismatchError, match=r"^restore into: 'b' is torch.int64\[4\] but the saved tensor is "
                                                     r"torch.int64\[3\]"):
            cache.restore("main", into={"a": into["a"], "b": into["b"]})
        with pytest.raises(StateMismatchError, match="'extra'"):
            cache.restore("main", into=into)
        assert torch.equal(into["a"], torch.zeros(6))  # nothing read
        state, unmatched = cache.restore("main", into=into, strict=False)
        assert unmatched == [
            "b: is torch.int64[4] but the saved tensor is torch.int64[3]",
            "extra: no tensor of that key in the version",
        ]
        assert torch.equal(into["a"], saved["a"]) and state["a"] is into["a"]
        assert torch.equal(state["b"], saved["b"]) and state["b"] is not into["b"]
