"""The group chaos test: random faults at every phase of multi-rank saves and restores, on 2-4 gloo ranks.

Each run draws a world (2, 3 or 4 ranks on one or two simulated nodes, each node with its own disk,
all sharing the real S3 server, peer copies between nodes) and a plan of trials: saves and
restores, every other one with a fault for one rank at one phase (:data:`SAVE_PHASES`,
:data:`RESTORE_PHASES`): it raises, skips the version, passes a bad input, sleeps past the
group's timeout, or saves a model declared replicated that differs from the other ranks';
:func:`test_a_rank_killed_at_any_phase_breaks_the_group_once` SIGKILLs one. Two more faults
are of whole calls: a ``dcp.save`` the rank aborts (its planner fails before its ``write_data``,
or its write fails), and S3 hanging for the rank while it saves (through a relay of its own).
Per trial, every surviving rank must report the same outcome, within the timeout and a few
seconds (a level not settled by then is a hang); a failure caused by the fault names its rank;
the trial after a fault saves a new version on every rank; and every version any rank reported
durable restores bit-exact on every rank and passes ``verify`` on every tier.

The seed is printed; ``TEST_TIERCACHE_CHAOS_SEED=<seed>`` replays a run. A default run has 12 faults
(24 trials); ``--slow`` runs 300 faults.
"""

from __future__ import annotations

import json
import os
import random
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _chaos_worker import equal, state
from test_multirank import free_port, rank_errs, rank_out, run_ranks

import tiercache
from tiercache.config import S3Config

#: Failpoints of a save's phases (see tiercache.failpoints), and of a restore's.
SAVE_PHASES = ("group.save", "group.stage", "group.trade", "group.parts", "group.write", "group.commit",
               "group.peers")
RESTORE_PHASES = ("group.restore", "group.fill")
BAD_INPUTS = ("meta", "step", "branch", "leaf", "optimizer")
#: The group's timeout. Short, so a fault that stalls past it costs seconds; not so short that a
#: loaded two-core machine (four ranks and the S3 server on it) makes a clean save miss it.
TIMEOUT = 4.0


def _fault(rng: random.Random, world: int, save: bool) -> dict[str, Any]:
    rank = rng.randrange(world)
    if not save:
        return {"rank": rank, "phase": rng.choice(RESTORE_PHASES), "kind": rng.choice(("raise", "delay"))}
    kind = rng.choices(("raise", "skip", "bad", "delay", "replica", "dcp", "s3hang"), weights=(3, 3, 3, 2, 1, 1, 1))[0]
    if kind == "replica":  # the rank's model, declared replicated, differs from the others'
        return {"rank": rank, "phase": "group.trade", "kind": "replica"}
    if kind == "dcp":  # a dcp.save the rank aborts: its planner fails before its write_data, or its write does
        return {"rank": rank, "phase": "dcp", "kind": "dcp", "variant": rng.choice(("plan", "write"))}
    if kind == "s3hang":  # the rank's S3 hangs (connections accepted, never answered) while it saves
        return {"rank": rank, "phase": "s3", "kind": "s3hang"}
    if kind == "bad":
        return {"rank": rank, "phase": "group.save", "kind": "bad", "variant": rng.choice(BAD_INPUTS)}
    fault = {"rank": rank, "phase": rng.choice(SAVE_PHASES), "kind": kind}
    if fault["phase"] in ("group.write", "group.commit"):
        fault["tier"] = rng.choice(("disk", "s3"))
    return fault


def make_plan(rng: random.Random, world: int, faults: int) -> list[dict[str, Any]]:
    """``faults`` trials with a fault, each followed by a clean save (the group must go on)."""
    trials: list[dict[str, Any]] = []
    for _ in range(faults):
        save = rng.random() < 0.8
        trial: dict[str, Any] = {"kind": "save" if save else "restore", "fault": _fault(rng, world, save)}
        if trial["fault"]["kind"] == "dcp":
            trial["kind"] = "dcp"
        trials += [trial, {"kind": "save"}]
    for n, t in enumerate(trials):
        t["step"] = n + 1
        t["replicated"] = rng.random() < 0.5 or t.get("fault", {}).get("kind") == "replica"
    return trials


def draw_world(rng: random.Random) -> tuple[int, list[str]]:
    world = rng.choice((2, 3, 4))
    if world == 2:
        nodes = rng.choice((["a", "a"], ["a", "b"]))
    else:
        split = rng.randrange(1, world)
        nodes = ["a"] * split + ["b"] * (world - split)
    return world, nodes


def setup(tmp_path: Path, s3_config: S3Config, nodes: list[str]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The ranks' config (default policy, S3, a disk per node, peer copies if two nodes) and environment."""
    config = {"disk": {"path": "unused"}, "s3": s3_config.model_dump(mode="json"), "ram": {"capacity": "16MiB"},
              "chunk_bytes": "64KiB", "pack_below": "8KiB", "peers": {"copies": 1 if len(set(nodes)) > 1 else 0}}
    env = [{"TIERCACHE_NODE": n, "TIERCACHE_DISK__PATH": str(tmp_path / f"disk-{n}")} for n in nodes]
    return config, env


def _seed() -> int:
    seed = int(os.environ.get("TEST_TIERCACHE_CHAOS_SEED") or random.randrange(1 << 30))
    print(f"chaos seed: {seed} (replay with TEST_TIERCACHE_CHAOS_SEED={seed})")
    return seed


def _store(world: int) -> dist.TCPStore:
    """The job's store, hosted here as torchrun's agent hosts it: a rank's death does not take it along."""
    return dist.TCPStore("127.0.0.1", free_port(), world, True, timeout=timedelta(seconds=60), wait_for_workers=False)


def _failure(res: dict[str, Any]) -> str | None:
    """Why a trial's version is not durable on this rank (``None``: it is)."""
    if "raised" in res:
        return str(res["raised"][1])
    levels = res.get("levels")
    if levels is None:
        return "no outcome"
    durable = levels["durable"]
    return None if durable == res["vid"] else str(durable[1])


def check_trial(trial: dict[str, Any], results: list[dict[str, Any]], bound: float) -> None:
    """Every rank's outcome of one trial is the same; a fault's failure names its rank; a clean save is durable."""
    fault = trial.get("fault")
    where = f"trial {trial['step']} {fault}"
    for res in results:
        for lvl, got in (res.get("levels") or {}).items():
            assert got[0] != "HANG" if isinstance(got, list) else True, f"{where}: rank {res}: {lvl} hangs"
        assert res["seconds"] <= bound, f"{where}: a rank took {res['seconds']}s: {res}"
    if trial["kind"] == "dcp":
        check_dcp_trial(fault, results, where)
        return
    if trial["kind"] == "restore":
        outcomes = [tuple(r["raised"]) if "raised" in r else ("restored", r["restored"][1]) for r in results]
        assert len(set(outcomes)) == 1, f"{where}: the ranks disagree: {outcomes}"
        if "raised" not in results[0]:
            assert all(r["restored"][1] and r["restored"][0] == r["restored"][2] for r in results), where
        elif any(r["fired"] for r in results):
            assert f"rank {fault['rank']}" in results[0]["raised"][1], where
        return
    if fault is not None and fault["kind"] == "s3hang":  # the disk's level never waits for S3
        held = next(r["local_in_hang"] for r in results if "local_in_hang" in r)
        assert held == results[0]["vid"], f"{where}: local while S3 hung: {held}"
    failures = [_failure(r) for r in results]
    with_levels = [r["levels"] for r in results if "levels" in r]
    assert all(lv == with_levels[0] for lv in with_levels), f"{where}: the ranks' levels differ: {with_levels}"
    assert all(f is None for f in failures) or all(f is not None for f in failures), f"{where}: {failures}"
    raised = [tuple(r["raised"]) for r in results if "raised" in r]
    if fault is None:
        assert failures == [None] * len(results), f"{where}: a save after a fault failed: {failures}"
        return
    if fault["phase"] == "group.save":  # refused in the first exchange: the same error on every rank
        assert len(raised) == len(results) and len(set(raised)) == 1, f"{where}: {raised}"
    if fault["kind"] == "replica":  # the one error of the trade names the tensor and the ranks
        differ = [fault["rank"]] if fault["rank"] else list(range(1, len(results)))
        named = f"tensors ['model/w'] were declared replicated but ranks {differ} hold other bytes than rank 0"
        assert failures[0] is not None and named in failures[0], f"{where}: {failures}"
        return
    if failures[0] is not None and any(r["fired"] for r in results):
        named = f"rank {fault['rank']}" if fault.get("variant") != "step" else f"{fault['rank']}"
        assert any(named in (f or "") for f in failures), f"{where}: the failure does not name the rank: {failures}"


def check_dcp_trial(fault: dict[str, Any], results: list[dict[str, Any]], where: str) -> None:
    """A dcp.save one rank aborted: DCP names that rank on every rank, and every rank that opened the version
    settles each level with the same error, naming that rank alone."""
    rank = fault["rank"]
    assert all(r["dcp_failures"] == [rank] for r in results), f"{where}: {results}"
    opened = [r["levels"] for r in results if r.get("levels") is not None]
    if fault["variant"] == "plan":  # the rank's DCP step failed before its write_data: it never opened the version
        assert len(opened) == len(results) - 1, f"{where}: {results}"
    assert opened and all(lv == opened[0] for lv in opened), f"{where}: the ranks' levels differ: {opened}"
    for lvl, got in opened[0].items():
        assert isinstance(got, list) and got[0] not in ("HANG", "SkippedError"), f"{where}: {lvl}: {got}"
    named = {int(n) for n in re.findall(r"\brank (\d+)", opened[0]["durable"][1])}
    assert named == {rank}, f"{where}: the failure names ranks {named}: {opened[0]['durable']}"


def check_tiers(tmp_path: Path, s3_config: S3Config, nodes: list[str], durable: set[str]) -> None:
    """Every tier passes verify, and S3 (which holds every part) restores each durable version bit-exact."""
    with tiercache.open({"s3": s3_config.model_dump(mode="json")}) as cache:
        assert cache.verify().ok
        for vid in durable & {v.id for v in cache.versions()}:
            whole = cache.restore(vid)
            step = cache.manifest(vid).step
            assert all(equal(whole[r], state(r, step)) for r in range(len(nodes))), vid
    for node in sorted(set(nodes)):
        with tiercache.open({"disk": {"path": str(tmp_path / f"disk-{node}")}, "node": node}) as cache:
            report = cache.verify()
            assert report.ok, report.to_json()


# The ranks' watchdog (each run's ``limit``) stops a hung run first, and shows where it hangs.
@pytest.mark.timeout(0)
def test_random_faults_at_every_phase_give_one_outcome_per_version(
    tmp_path: Path, s3_config: S3Config, slow: bool
) -> None:
    rng = random.Random(_seed())
    total = 300 if slow else 12
    done = 0
    run = 0
    while done < total:
        faults = min(total - done, 30)
        world, nodes = draw_world(rng)
        plan = make_plan(rng, world, faults)
        work = tmp_path / f"run{run}"
        run_dir = tmp_path / f"tiers{run}"
        config, env = setup(run_dir, s3_config, nodes)
        config["s3"]["url"] = config["s3"]["url"].rstrip("/") + f"/chaos{run}"
        work.mkdir(parents=True)
        (work / "plan.json").write_text(json.dumps({"trials": plan, "timeout": TIMEOUT}))
        store = _store(world)
        limit = 60 + 12 * len(plan)
        codes = run_ranks("_chaos_worker:chaos", world, work, config, env=env, timeout=limit,
                          opts={"store": store.port, "timeout": TIMEOUT, "watchdog": limit, "s3_proxy": True})
        assert codes == [0] * world, f"{(world, nodes, codes)}\n{rank_errs(work, world)}"
        outs = [rank_out(work, r, "results") for r in range(world)]
        bound = 2 * TIMEOUT + 20
        for i, trial in enumerate(plan):
            check_trial(trial, [o["results"][i] for o in outs], bound)
        durable = {r["vid"] for o in outs for r in o["results"] if "vid" in r and _failure(r) is None}
        for o in outs:
            assert {vid for vid, _ in o["restores"]} == durable
            assert all(ok is True for _, ok in o["restores"]), o["restores"]
        check_tiers(run_dir, config_s3(config), nodes, durable)
        done += faults
        run += 1


def config_s3(config: dict[str, Any]) -> S3Config:
    return S3Config(**config["s3"])


@pytest.mark.parametrize("trial", range(2))
def test_a_rank_killed_at_any_phase_breaks_the_group_once(
    tmp_path: Path, s3_config: S3Config, trial: int
) -> None:
    rng = random.Random(_seed() + trial)
    world, nodes = 3, ["a", "a", "b"]
    fault = {"rank": rng.randrange(world), "phase": rng.choice(SAVE_PHASES), "kind": "kill"}
    plan = [{"kind": "save", "step": 1, "replicated": True},
            {"kind": "save", "step": 2, "replicated": True, "fault": fault}]
    config, env = setup(tmp_path, s3_config, nodes)
    config["s3"]["url"] = config["s3"]["url"].rstrip("/") + f"/kill{trial}"
    work = tmp_path / "work"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps({"trials": plan, "timeout": TIMEOUT, "kills": True}))
    store = _store(world)
    codes = run_ranks("_chaos_worker:chaos", world, work, config, env=env, timeout=120,
                      opts={"store": store.port, "timeout": TIMEOUT, "broken": True})
    dead = fault["rank"]
    if codes[dead] != -9:  # the phase never came on that rank (it leads no node, say): a clean run
        assert codes == [0] * world, (fault, codes)
        return
    assert [c for r, c in enumerate(codes) if r != dead] == [0] * (world - 1), (fault, codes)
    outs = [rank_out(work, r, "results") for r in range(world) if r != dead]
    assert all(o["results"][0]["levels"]["durable"] == o["results"][0]["vid"] for o in outs)
    check_trial({"kind": "save", "step": 2, "fault": {**fault, "kind": "raise"}},
                [o["results"][1] for o in outs], 2 * TIMEOUT + 20)
    # Later saves fail at once (not after a timeout), the same way on every survivor, naming the dead rank.
    afters = {tuple(o["after"]) for o in outs}
    assert len(afters) == 1, afters
    [(name, message)] = afters
    assert name == "GroupBrokenError" and f"rank {dead}" in message, (fault, afters, [o["results"][1] for o in outs])
    assert all(o["after_seconds"] < TIMEOUT for o in outs)
    durable = {r["vid"] for o in outs for r in o["results"] if "vid" in r and _failure(r) is None}
    check_tiers(tmp_path, config_s3(config), nodes, durable)


@pytest.mark.parametrize("view", ["distributed", "first save"])
def test_a_rank_whose_s3_hangs_saves_and_reaches_local_and_its_remote_fails_naming_it(
    tmp_path: Path, s3_config: S3Config, view: str
) -> None:
    # Rank 1 reaches S3 through a relay of its own, which hangs (connections accepted, never
    # answered) from before the group's first save until every rank read every level. Before,
    # rank 1's save() listed S3 (the catalog's first load, then catch-up's reload holding the
    # catalog's lock) for the S3 client's timeouts and retries (~100 s), so the group's save
    # failed on every rank after the group's timeout; and its `remote` waited for its upload.
    world, nodes = 2, ["a", "b"]
    config, env = setup(tmp_path, s3_config, nodes)
    if view == "first save":
        # No cache.distributed() first: rank 1's first save(group=) makes its view, whose first load
        # of the catalog finds S3 hanging. Before, it listed S3 for the client's timeouts and retries
        # (~100 s); now it probes S3 (here within 0.5 s, well inside the group's timeout) and goes on.
        config["s3"]["probe_timeout"] = 0.5
    work = tmp_path / "work"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps({"timeout": TIMEOUT}))
    store = _store(world)
    codes = run_ranks("_chaos_worker:s3hang", world, work, config, env=env, timeout=120,
                      opts={"store": store.port, "timeout": TIMEOUT, "watchdog": 120, "s3_proxy": True, "view": view})
    assert codes == [0] * world
    outs = [rank_out(work, r) for r in range(world)]
    vid = outs[0].get("vid")
    assert vid is not None and outs[1].get("vid") == vid, outs
    remote = ["GroupSaveError", f"version {vid} on s3 failed: rank 1 (node b) did not answer within {TIMEOUT:g}s "
              "(still writing to s3)"]
    if view == "first save":  # rank 1's view found S3 hanging (its probe timed out): S3 is down there, skipped
        why = outs[1]["levels"]["remote"][1]
        assert re.fullmatch(rf"version {vid} on s3 skipped: rank 1 \(node b\): version {vid} skipped for s3: s3 "
                            r"unavailable \(TierUnavailableError: S3 endpoint http://127\.0\.0\.1:\d+ unreachable "
                            r"\(ReadTimeoutError\): check s3.endpoint_url and that the server is running\)", why), why
        remote = ["SkippedError", why]
    assert outs[1]["hanging"] is True
    for out in outs:
        # `local` (and the peer copies, and so `durable`) while rank 1's S3 still hangs; `remote`
        # failed on every rank alike, naming rank 1 and S3, with no wait for the S3 client.
        assert out["levels"] == {"local": vid, "replicated": vid, "remote": remote, "durable": vid}, out
        assert out["restored"] is True  # bit-exact, once S3 answers again
