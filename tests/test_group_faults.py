"""One fault at a time, as users hit them: each of these broke the group before it had one collective layer.

Every rank is a forked process (``_faults_worker.py``) on gloo, with the real local S3 server
where a test uses S3. See tests/test_group_chaos.py for the random faults at every phase.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_multirank import rank_out, run_ranks
from test_nodes import base_config, node_env

from tiercache.config import S3Config


def _run(name: str, world: int, work: Path, config: dict[str, Any], **kw: Any) -> list[int]:
    return run_ranks(f"_faults_worker:{name}", world, work, config, **kw)


def test_a_rank_that_skips_a_version_never_mixes_versions(tmp_path: Path) -> None:
    # Rank 1's arena is full when version 2 comes (its disk write of version 1 is held) and its
    # policy skips the version; the ranks trade ids of the model's chunks (replicated=). Before,
    # the trade paired versions by call order: version 3 named rank 0's step-3 chunks and rank 1's
    # step-2 ones, both ranks said durable, and restore failed its integrity check.
    config = base_config(ram={"capacity": "100KiB"}, chunk_bytes="64KiB", pack_below="4KiB",
                         policy={"name": "write-through", "params": {"on_full": "skip"}})
    work = tmp_path / "work"
    env = node_env(tmp_path, ["a", "a"])
    env[0]["TIERCACHE_RAM__CAPACITY"] = "4MiB"  # rank 0's arena has room for both versions
    assert _run("arena_skip", 2, work, config, env=env) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    v1, v2, v3 = outs[0]["ids"]
    assert outs[1]["ids"] == [v1, v2, v3]
    for out in outs:
        assert out["v1"] == {"local": v1, "durable": v1} and out["v3"] == {"local": v3, "durable": v3}
        name, message = out["v2"]["durable"]
        assert name == "SkippedError" and "rank 1" in message and "arena is full" in message
        assert out["v2"] == outs[0]["v2"]
        assert out["v3_equal"] is True and out["v1_equal"] is True


def test_a_bad_input_on_one_rank_fails_every_rank_at_once_naming_it(tmp_path: Path) -> None:
    # The group's default timeout (10 minutes): a rank that raised before the first exchange used
    # to leave the others waiting inside save() for all of it.
    work = tmp_path / "work"
    config = base_config()
    assert _run("bad_input", 3, work, config, env=node_env(tmp_path, ["a", "a", "b"]), timeout=120,
                opts={"timeout": 600}) == [0, 0, 0]
    outs = [rank_out(work, r) for r in range(3)]
    for name, error, words in (
        ("meta", "InvalidArgumentError", ["rank 1 (node a)", "meta must be JSON-able"]),
        ("step", "InvalidArgumentError", ["rank(s) 0, 2 step 2", "rank(s) 1 step 3"]),
        ("leaf", "UnsupportedStateError", ["rank 1 (node a)", "lock"]),
    ):
        raised = [o[name].get("raised", o[name]) for o in outs]
        assert raised[0] == raised[1] == raised[2], (name, raised)
        assert raised[0][0] == error and all(w in raised[0][1] for w in words), (name, raised[0])
        assert all(o[name]["seconds"] < 30 for o in outs)
    # Rank 1's arena cannot hold its part: its save() raises, the others' version fails naming it.
    assert outs[1]["arena"].get("raised", [outs[1]["arena"]])[0] == "TierFullError"
    for o in (outs[0], outs[2]):
        name, message = o["arena"]["returned"]["durable"]
        assert name == "GroupSaveError" and "rank 1 (node a): TierFullError" in message
    assert outs[0]["arena"]["returned"] == outs[2]["arena"]["returned"]
    for o in outs:  # and the group goes on
        assert o["after"]["durable"] == outs[0]["after"]["durable"] != outs[0]["after"]["local"][0]
        assert o["after_equal"] is True


def test_ranks_whose_configs_differ_in_a_layout_setting_say_which_and_who(tmp_path: Path) -> None:
    env = node_env(tmp_path, ["a", "a", "a"])
    env[2]["TIERCACHE_PACK_BELOW"] = "8KiB"  # the ranks' chunk layouts would differ
    work = tmp_path / "work"
    assert _run("config_differs", 3, work, base_config(), env=env) == [0, 0, 0]
    errors = [rank_out(work, r)["view_error"] for r in range(3)]
    assert errors[0] == errors[1] == errors[2]
    name, message = errors[0]
    assert name == "ConfigError" and "pack_below is 16384 on rank 0 but 8192 on rank(s) 2" in message


def test_a_rank_that_raises_right_after_save_still_completes_the_version(tmp_path: Path, s3_config: S3Config
                                                                         ) -> None:
    # Rank 1's training code raises after save() returned, and its process exits. Before, thread
    # pools refused work at exit ("cannot schedule new futures after interpreter shutdown"): the
    # version was lost for every rank, and rank 0's next save met a raw "Connection closed by peer".
    config = base_config(s3=s3_config.model_dump(mode="json"))
    work = tmp_path / "work"
    codes = _run("raise_after_save", 2, work, config, env=node_env(tmp_path, ["a", "b"]),
                 opts={"exit": "normal", "broken": True, "timeout": 5})
    assert codes == [0, 1]
    out = rank_out(work, 0)
    assert out["v1"]["local"] == out["v1"]["durable"] and out["v1"]["local"][0] != "GroupSaveError"
    name, message = out["next"]
    assert name == "GroupBrokenError" and "rank 1 (node b) is gone" in message


def test_versions_a_full_disk_loses_are_counted_and_raised_by_flush_on_every_rank(tmp_path: Path) -> None:
    from test_multirank import rank_out, run_ranks
    from test_nodes import base_config, node_env

    work = tmp_path / "work"
    assert run_ranks("nodes_disk_full", 2, work, base_config(), env=node_env(tmp_path, ["a", "b"]),
                     opts={"timeout": 5}) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    v1, v2 = outs[0]["versions"]
    for out in outs:
        assert out["versions"] == [v1, v2] and out["lost"] == 2  # both counted, on every rank
        # flush() raises the first, as the version's durable level says it failed.
        assert out["flush"] == out["levels"][0]["durable"] == [
            "GroupSaveError", f"version {v1} on disk failed: rank 1 (node b): TierFullError: injected: node b's "
            "disk is full"]


def test_a_group_restore_reports_the_time_of_its_exchanges_too(tmp_path: Path) -> None:
    work = tmp_path / "work"
    assert run_ranks("restore_seconds", 2, work, base_config(), env=node_env(tmp_path, ["a", "b"])) == [0, 0]
    for r in range(2):
        out = rank_out(work, r)
        # At least the second the resolving exchange was held (the reads alone take far less).
        assert out["equal"] is True and out["seconds"] >= 1.0


def test_a_rank_that_skips_a_save_fails_that_call_everywhere_naming_it_and_the_group_goes_on(tmp_path: Path
                                                                                             ) -> None:
    # Rank 1's loop skips its save of step 2. Before, its save of step 3 met the others' step 2,
    # every error was prefixed "rank 0 (node a)", and each later call met the other ranks' call
    # of the step before: the ranks stayed out of step for good.
    work = tmp_path / "work"
    assert _run("out_of_step", 3, work, base_config(), env=node_env(tmp_path, ["a", "b", "b"]),
                opts={"timeout": 5}) == [0, 0, 0]
    outs = [rank_out(work, r) for r in range(3)]
    error = ["InvalidArgumentError", "the group's save of step 2 failed: rank 1 (node b): InvalidArgumentError: the "
             "ranks save different versions (rank(s) 0, 2 step 2 on 'main'; rank(s) 1 step 3 on 'main'): every rank "
             "must save the same step on the same branch (a rank skipped a save or made one more); a rank's own "
             "later call of a step another rank saved in this call fails at once with this error, and the group "
             "saves again from the first step every rank saves"]
    v1, v4 = outs[0]["calls"]["1"]["vid"], outs[0]["calls"]["4"]["vid"]
    for out in outs:
        calls = out["calls"]
        assert calls["1"]["levels"] == {"local": v1, "durable": v1}
        # Every call of the steps rank 1 was out of step for fails with the one error.
        assert [calls[s]["raised"] for s in ("2", "3") if s in calls] == ([error] if out["rank"] == 1 else [error] * 2)
        assert calls["4"]["vid"] == v4 and calls["4"]["levels"] == {"local": v4, "durable": v4}
        assert out["parent4"] == v1 and out["head"] == v4 and out["v4_equal"] is True



def test_a_rank_that_skips_a_save_held_up_by_a_training_collective_is_in_step_at_its_next_save(tmp_path: Path
                                                                                              ) -> None:
    # As above, but a collective of the trainer's own ends each step (DDP's all-reduce): rank 1
    # waits there while the others wait for it in save(step=2), until that save times out naming
    # rank 1. Before, rank 1's save of step 3 then met that verdict and failed, and each later
    # save met the others' call of the step before, timing out again: out of step for good.
    work = tmp_path / "work"
    assert _run("out_of_step", 3, work, base_config(), env=node_env(tmp_path, ["a", "b", "b"]),
                opts={"timeout": 3, "collective": True}) == [0, 0, 0]
    outs = [rank_out(work, r) for r in range(3)]
    v3, v4 = (outs[0]["calls"][s]["vid"] for s in ("3", "4"))
    for out in outs:
        calls = out["calls"]
        if out["rank"] != 1:
            name, message = calls["2"]["raised"]
            assert name == "GroupSaveError" and message.startswith("the group's save of step 2 failed: rank 1 (node b) "
                                                                   "did not answer within 3s"), message
        assert "2" not in calls if out["rank"] == 1 else True
        for step, vid in (("3", v3), ("4", v4)):
            assert calls[step]["vid"] == vid and calls[step]["levels"] == {"local": vid, "durable": vid}
        assert out["parent4"] == v3 and out["head"] == v4 and out["v4_equal"] is True


def test_a_disk_too_small_on_one_node_fails_every_rank_naming_the_rank_and_the_full_disk(tmp_path: Path) -> None:
    # Node b's disk (its only durable tier) cannot hold a version. Before, the first version
    # failed as a policy skip (uncounted), and a version whose pipeline on rank 1 ended before the
    # group asked for its part failed with "version ... was not staged here".
    work = tmp_path / "work"
    env = node_env(tmp_path, ["a", "b"])
    env[1]["TIERCACHE_DISK__CAPACITY"] = "64KiB"
    assert _run("small_disk", 2, work, base_config(), env=env, opts={"timeout": 5}) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    assert outs[0]["versions"] == outs[1]["versions"] and outs[0]["levels"] == outs[1]["levels"]
    full = "disk is full and nothing on it may be evicted: no other durable tier holds its versions yet"
    for vid, levels in zip(outs[0]["versions"], outs[0]["levels"], strict=True):
        for name, message in levels.values():
            assert name == "GroupSaveError" and message.startswith(f"version {vid} on disk failed: rank 1 (node b): ")
            assert f"TierFullError: {full}" in message, message
    for out in outs:  # lost, not skipped: counted and raised
        assert out["flush"] == outs[0]["levels"][0]["durable"] and out["lost"] == 3
