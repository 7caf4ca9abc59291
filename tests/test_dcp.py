"""The DCP integration: dcp.save/async_save with 4 gloo ranks, dcp.load with 2 ranks and with one process."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _multirank_worker import full_tensors
from test_multirank import cache_config, one_tier, rank_out, run_ranks

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import IntegrityError, InvalidArgumentError
from tiercache.integrations.dcp import (
    TierCacheStorageReader,
    TierCacheStorageWriter,
    _load_metadata,
    load_whole,
    to_torch_save,
)


def test_save_four_ranks_load_two_ranks_and_one_process(tmp_path: Path, s3_config: S3Config) -> None:
    config = cache_config(tmp_path, s3_config)
    assert run_ranks("dcp_save", 4, tmp_path / "save", config) == [0, 0, 0, 0]
    v1, v2 = rank_out(tmp_path / "save", 0)["versions"]
    assert v1 and v2 and v1 != v2

    # Both tiers hold both versions as ordinary tiercache versions on main, v2 after v1.
    for tier in ("disk", "s3"):
        with one_tier(config, tier) as cache:
            assert cache.resolve("main") == v2
            assert cache.manifest(v2).parent == v1 and cache.manifest(v2).step == 2
            assert cache.manifest(v1).meta == {"via": "dcp"}

    # Resharded: 4 ranks saved, 2 ranks load.
    assert run_ranks("dcp_load", 2, tmp_path / "load", config) == [0, 0]
    for r in range(2):
        assert rank_out(tmp_path / "load", r)["equal"] == {"main": [2, True, True], "main~1": [1, True, True]}

    # And one process without torch.distributed, from S3 alone.
    with one_tier(config, "s3") as cache:
        state = {"w": torch.zeros(64, 512), "emb": torch.zeros(96, 256), "step": 0}
        dcp.load(state, storage_reader=TierCacheStorageReader(cache, v1), no_dist=True)
        full = full_tensors(1)
        assert state["step"] == 1 and torch.equal(state["w"], full["w"]) and torch.equal(state["emb"], full["emb"])
        # Whole, without a target state (what dcp_to_torch_save reads from a directory).
        whole = load_whole(cache, "main")
        assert sorted(whole) == ["emb", "step", "w"] and whole["step"] == 2
        assert all(torch.equal(whole[k], v) for k, v in full_tensors(2).items())


def test_one_disk_per_node_survives_the_loss_of_a_node_with_peer_copies(tmp_path: Path) -> None:
    # Two nodes, each with its own disk and no S3; each node's part is copied to the other.
    from test_nodes import base_config, node_env, stored_chunks

    env = node_env(tmp_path, ["a", "b"])
    config = base_config(peers={"copies": 1})
    assert run_ranks("dcp_nodes", 2, tmp_path / "save", config, env=env) == [0, 0]
    outs = [rank_out(tmp_path / "save", r) for r in range(2)]
    v1, v2 = outs[0]["versions"]
    assert outs[1]["versions"] == [v1, v2] and outs[0]["levels"] == outs[1]["levels"]
    for vid, levels in zip((v1, v2), outs[0]["levels"], strict=True):
        assert levels["local"] == levels["replicated"] == levels["durable"] == vid
    disks = {n: tmp_path / f"disk-{n}" for n in "ab"}
    # Each node committed the version on its own disk, with its own part and, as the other's peer,
    # the other's: every chunk of the checkpoint is on both disks.
    for node in "ab":
        with tiercache.open({"disk": {"path": str(disks[node])}}) as cache:
            assert cache.resolve("main") == v2 and cache.manifest("main~1").id == v1
            whole = cache.manifest("main")
            assert not whole.is_header and whole.ranks == 2
            assert {c.id for c in whole.chunks} <= stored_chunks(disks[node])
    # Node b is lost with its disk; a replacement with an empty disk loads both versions bit-exact.
    shutil.rmtree(disks["b"])
    assert run_ranks("dcp_load", 2, tmp_path / "load", config, env=env) == [0, 0]
    for r in range(2):
        assert rank_out(tmp_path / "load", r)["equal"] == {"main": [2, True, True], "main~1": [1, True, True]}


def test_a_save_aborted_by_one_rank_fails_alike_everywhere_and_the_next_saves_go_through(
        tmp_path: Path, s3_config: S3Config) -> None:
    # Three nodes with their own disks and S3; node b refuses every write during the first dcp.save.
    from test_nodes import base_config, node_env

    config = base_config(s3=s3_config.model_dump(mode="json"))
    work = tmp_path / "save"
    assert run_ranks("dcp_abort", 3, work, config, env=node_env(tmp_path, ["a", "b", "c"]),
                     opts={"timeout": 5}) == [0, 0, 0]
    outs = [rank_out(work, r) for r in range(3)]
    v1 = outs[0]["aborted"][0]
    failed = ["GroupSaveError", f"version {v1} at staging failed: rank 1 (node b): StorageError: injected: node b "
              "refuses the write"]
    no_peers = ["ConfigError", "no 'replicated' level: [peers] copies is 0 (set it to 1 or more)"]

    def levels(each: object) -> dict[str, object]:
        return {"local": each, "replicated": no_peers, "remote": each, "durable": each}

    v2, v3, w = outs[0]["dcp"][0], outs[0]["group"][0], outs[0]["plan_aborted"][0]
    for out in outs:
        assert out["abort"] == [1]  # DCP names the rank at fault
        # Every level of the aborted version settled, with one error naming the rank and its cause.
        assert out["aborted"] == [v1, levels(failed)]
        # Rank 1's DCP step failed before it wrote (it has no round): the others give up on it.
        assert out["plan_abort"] == [1]
        # The verdict names rank 1 alone: rank 0 was there, waiting for DCP's finish().
        late = ["GroupSaveError", f"version {w} at staging failed: rank 1 (node b) did not answer within 5s"]
        assert out["plan_aborted"] == ([None, None] if out["rank"] == 1 else [w, levels(late)])
        assert out["dcp"] == [v2, levels(v2)] and out["group"] == [v3, levels(v3)]
        assert out["equal"] == [2, True, True]  # the next checkpoint restores bit-exact
        assert out["last_restore"] == v2
    with one_tier(config, "s3") as cache:
        assert cache.manifest("main").parent == v2 and cache.manifest(v2).parent is None


def test_a_save_either_of_two_ranks_aborts_before_writing_fails_alike_and_the_next_saves_go_through(
        tmp_path: Path) -> None:
    # Two ranks on one node, no S3: rank 1's DCP step fails before its write_data, so it never
    # opens the version, and no third rank gives up on it. Before, rank 0 (the coordinator,
    # waiting for DCP's finish() at the parts phase) waited for rank 1 forever: its levels never
    # settled, and every later save of the group hung behind it. Then rank 0's own step fails
    # there: before, its view of the branch kept the version it had proposed, so the next
    # version named it (a version no tier holds) as its parent.
    from test_nodes import base_config, node_env

    work = tmp_path / "save"
    assert run_ranks("dcp_plan_abort", 2, work, base_config(), env=node_env(tmp_path, ["a", "a"]),
                     timeout=90, opts={"timeout": 2}) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    no_s3 = ["ConfigError", "no s3 tier configured, so no 'remote' level"]

    def late(vid: str, rank: int) -> dict[str, object]:
        failed = ["GroupSaveError", f"version {vid} at staging failed: rank {rank} did not answer within 2s"]
        return {"local": failed, "remote": no_s3, "durable": failed}

    w1, w0 = outs[0]["aborted1"][0], outs[1]["aborted0"][0]
    for out in outs:
        for key, vid in (("dcp", out["dcp"][0]), ("group", out["group"][0])):
            assert out[key] == [vid, {"local": vid, "remote": no_s3, "durable": vid}], (key, out)
        # DCP names the rank at fault; the ranks that opened the version settle it naming that rank.
        assert out["abort1"] == [1] and out["abort0"] == [0]
        assert out["aborted1"] == ([None, None] if out["rank"] == 1 else [w1, late(w1, 1)])
        assert out["aborted0"] == ([None, None] if out["rank"] == 0 else [w0, late(w0, 0)])
        assert out["equal"] == [3, True, True]  # the next checkpoint restores bit-exact
    v3, v4 = outs[0]["dcp"][0], outs[0]["group"][0]
    assert outs[1]["dcp"][0] == v3 and outs[1]["group"][0] == v4
    # No aborted version is anyone's parent: rank 0 had moved its view of the branch to the one
    # it proposed, and never took it back.
    with tiercache.open({"disk": {"path": str(tmp_path / "disk-a")}}) as cache:
        assert [cache.manifest(v).parent for v in (v4, v3)] == [v3, None]


def test_every_mode_of_dcp_save_on_two_ranks_loads_what_it_saved(tmp_path: Path) -> None:
    # A writer reused without a checkpoint_id once loaded the first save's tensors; no_dist and
    # use_collectives=False while the group was up waited for ranks that never came.
    from test_nodes import base_config, node_env

    work = tmp_path / "save"
    assert run_ranks("dcp_modes", 2, work, base_config(), env=node_env(tmp_path, ["a", "b"])) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    v1, v2, v3 = outs[0]["versions"]
    assert len({v1, v2, v3}) == 3
    for out in outs:
        assert out["versions"] == [v1, v2, v3]
        assert out["reused"] == {"main": [2, True, True], "main~1": [1, True, True]}
        assert out["tagged"] == [3, True, True] and out["group_after"] == [3, True, True]
        assert out["own"][1] == [5, True, True]
    assert outs[0]["solo"][1] == [4, True, True] and "solo" not in outs[1]
    for node, out in zip("ab", outs, strict=True):
        with tiercache.open({"disk": {"path": str(tmp_path / f"disk-{node}")}}) as cache:
            # The second save is a version of its own, with just its own entries, child of the first.
            assert cache.manifest(v2).parent == v1 and cache.manifest(v3).parent == v2
            assert len(cache.manifest(v2).tensors) == len(cache.manifest(v1).tensors)
            assert cache.refs()["tag/best"] == v3
            assert cache.refs()[f"branch/rank{out['rank']}"] == out["own"][0]
    with tiercache.open({"disk": {"path": str(tmp_path / "disk-a")}}) as cache:
        assert cache.refs()["branch/solo"] == outs[0]["solo"][0]


def test_a_reused_writer_saves_each_checkpoint_afresh_and_checkpoint_id_names_a_tag(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as c:
        writer = TierCacheStorageWriter(c, step=1)
        for step in (1, 2):
            writer.step = step
            dcp.save({"w": torch.full((4,), float(step)), "step": step}, storage_writer=writer)
        out = {"w": torch.zeros(4), "step": 0}
        dcp.load(out, storage_reader=TierCacheStorageReader(c, "main"))
        assert torch.equal(out["w"], torch.full((4,), 2.0)) and out["step"] == 2
        assert len(c.manifest("main").tensors) == len(c.manifest("main~1").tensors)
        writer.step = 3
        dcp.save({"w": torch.full((4,), 3.0), "step": 3}, storage_writer=writer, checkpoint_id="best")
        dcp.save({"w": torch.full((4,), 4.0), "step": 4}, storage_writer=writer)  # no tag this time
        assert c.refs()["tag/best"] == c.resolve("main~1")
        out = {"w": torch.zeros(4), "step": 0}
        dcp.load(out, checkpoint_id="best", storage_reader=TierCacheStorageReader(c))
        assert torch.equal(out["w"], torch.full((4,), 3.0)) and out["step"] == 3
        head = c.resolve("main")
        for call in (lambda: dcp.save({"w": torch.ones(4)}, storage_writer=writer, checkpoint_id=tmp_path / "x"),
                     lambda: dcp.save({"w": torch.ones(4)}, storage_writer=writer, checkpoint_id="ckpt/step5")):
            with pytest.raises(InvalidArgumentError, match=r"^TierCacheStorageWriter: checkpoint_id '.*' is a path, "
                               "but a tiercache checkpoint is a version of the cache's tiers: leave checkpoint_id "
                               "out, or give a tag name$"):
                call()
        with pytest.raises(InvalidArgumentError, match=r"^TierCacheStorageReader: checkpoint_id 'ckpt/step5' is a "
                           "path"):
            dcp.load(out, checkpoint_id="ckpt/step5", storage_reader=TierCacheStorageReader(c))
        assert c.resolve("main") == head  # nothing saved by the refused calls


def test_a_checkpoint_converts_to_one_torch_save_file(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(8, 4), "b": torch.arange(4)}, "step": 9, "note": "x"}
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as c:
        dcp.save(state, storage_writer=TierCacheStorageWriter(c, step=9), no_dist=True)
        to_torch_save(c, "main@9", tmp_path / "whole.pt")
    got = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert sorted(got) == ["model", "note", "step"] and (got["step"], got["note"]) == (9, "x")
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and torch.equal(got["model"]["b"], state["model"]["b"])


def test_the_writer_refuses_to_move_to_another_process_in_one_line(tmp_path: Path) -> None:
    # dcp.async_save's process executor pickles the writer; it holds the open cache.
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as c, pytest.raises(
            TypeError, match=r"^TierCacheStorageWriter holds the open cache, which cannot move to another process: "
            r"use dcp.async_save with its default thread executor "):
        pickle.dumps(TierCacheStorageWriter(c, step=1))


def test_single_process_roundtrip_dedups_unchanged_shards(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}, "chunk_bytes": "64KiB", "pack_below": "4KiB"}) as c:
        base = {"frozen": torch.arange(65536, dtype=torch.float32), "head": torch.ones(8), "note": "hi"}
        dcp.save(base, storage_writer=TierCacheStorageWriter(c, step=1), no_dist=True)
        chunks_after_first = set(core_of(c).catalog.chunks_on("disk"))
        dcp.save({**base, "head": torch.full((8,), 2.0)}, storage_writer=TierCacheStorageWriter(c, step=2),
                 no_dist=True)
        v1, v2 = c.manifest("main~1"), c.manifest("main")
        frozen = [t for t in v2.tensors if t.path.startswith("frozen@")]
        assert [p.chunk for p in frozen[0].pieces] and {v2.chunks[p.chunk].id for p in frozen[0].pieces} <= {
            ch.id for ch in v1.chunks} <= chunks_after_first
        out = {"frozen": torch.zeros(65536), "head": torch.zeros(8), "note": ""}
        assert c.last_restore is None
        dcp.load(out, storage_reader=TierCacheStorageReader(c, "main"), no_dist=True)
        assert torch.equal(out["frozen"], base["frozen"]) and torch.equal(out["head"], torch.full((8,), 2.0))
        # Reported as a restore is: every chunk of v2 was read once, from the disk.
        assert c.last_restore is not None and c.last_restore.version == v2.id
        assert c.last_restore.nbytes == {"disk": sum(ch.nbytes for ch in v2.chunks)}
        assert out["note"] == "hi"
        # A DCP version restores through the plain API as its flat shards.
        flat = c.restore("main")
        assert torch.equal(flat["head@0"], torch.full((8,), 2.0))


def test_reader_refuses_plain_versions_and_foreign_pickles(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as c:
        c.save({"w": torch.ones(2)}, step=1).wait("local")
        with pytest.raises(InvalidArgumentError):
            TierCacheStorageReader(c, "main").read_metadata()
    evil = pickle.dumps(io.BytesIO(b"x"))
    with pytest.raises(IntegrityError):
        _load_metadata(evil)
