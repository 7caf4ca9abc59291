"""Many nodes (tiercache.group: topology, peers, restore): node-local disks, peer copies, read once.

Nodes are simulated on this machine: every rank gets ``TIERCACHE_NODE`` and a disk directory of
its node (``TIERCACHE_DISK__PATH``), so the ranks of a node share a directory and nodes share
nothing but the S3 prefix, reached through a relay that counts bytes and can refuse connections.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _multirank_worker import node_state, replica_state
from test_multirank import free_port, rank_out, run_ranks

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import ConfigError, IntegrityError
from tiercache.group.peers import copy_moves
from tiercache.group.restore import plan_moves
from tiercache.group.topology import Topology, choose_peers
from tiercache.group.transfer import Move, batches
from tiercache.manifest import ChunkRef, NodePart, Version, utcnow
from tiercache.names import chunk_key, part_key
from tiercache.parts import rank_view
from tiercache.restore import chunk_targets, empty_aligned
from tiercache.testing import ThrottledProxy


def node_env(tmp_path: Path, nodes: list[str]) -> list[dict[str, str]]:
    """Per rank: its node and that node's own disk directory."""
    return [{"TIERCACHE_NODE": n, "TIERCACHE_DISK__PATH": str(tmp_path / f"disk-{n}")} for n in nodes]


def base_config(**extra: Any) -> dict[str, Any]:
    # The disk path is per node (TIERCACHE_DISK__PATH); this one is never used.
    return {"disk": {"path": "unused"}, "ram": {"capacity": "16MiB"}, "chunk_bytes": "1MiB", "pack_below": "16KiB",
            "policy": {"name": "write-through"}, **extra}


def stored_chunks(disk: Path) -> set[str]:
    return {p.name for p in (disk / "chunks").glob("*/*")}


def part_chunks(version: Version, rank: int | None = None) -> set[str]:
    """The chunks rank ``rank``'s part of a merged ``version`` reads (``rank=None``: ``version`` is a part)."""
    view = rank_view(version, rank) if rank is not None else version
    return {view.chunks[p.chunk].id for t in view.tensors for p in t.pieces}


def part_bytes(version: Version, rank: int | None = None) -> int:
    sizes = {c.id: c.nbytes for c in version.chunks}
    return sum(sizes[c] for c in part_chunks(version, rank))


def test_two_nodes_each_hold_and_restore_their_own_part(tmp_path: Path) -> None:
    env = node_env(tmp_path, ["a", "b"])
    work = tmp_path / "work"
    assert run_ranks("nodes_save", 2, work, base_config(), env=env) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    v2 = outs[0]["v2_levels"]["local"]
    for out in outs:
        assert out["v2_levels"]["local"] == out["v2_levels"]["durable"] == v2
        assert out["v2_levels"]["replicated"][0] == "ConfigError" and "copies is 0" in out["v2_levels"]["replicated"][1]
        assert out["restored_equal"] is True and out["restored_in_place"] is True
    # A rank whose into= does not match fails the restore on every rank with the same error, naming
    # that rank and the tensor; nothing is read.
    assert outs[1]["mismatch"] == outs[0]["mismatch"]
    assert outs[0]["mismatch"][0] == "StateMismatchError"
    assert "rank 1 (node b)" in outs[0]["mismatch"][1] and "'shard'" in outs[0]["mismatch"][1]
    # `local` is true on every node: each holds the group manifest, the ref, and its own part: the
    # part manifest and its chunks (never the other node's).
    disks = {n: tmp_path / f"disk-{n}" for n in "ab"}
    parts = {}
    for rank, node in enumerate("ab"):
        with tiercache.open({"disk": {"path": str(disks[node])}}) as cache:
            assert cache.resolve("main") == v2
            header = cache.manifest("main")
            assert header.is_header and (header.id, header.ranks) == (v2, 2)
            assert header.nodes == (NodePart(name="a", ranks=(0,)), NodePart(name="b", ranks=(1,)))
            assert (disks[node] / "versions" / f"{v2}.json").read_bytes() == header.to_json()
            parts[rank] = core_of(cache).catalog.part(header, rank)
            assert core_of(cache).catalog.part(header, 1 - rank) is None
            # One process on one node cannot restore the whole version: it says which parts it lacks.
            with pytest.raises(IntegrityError, match=f"parts of ranks {1 - rank} are on no tier"):
                cache.restore("main")
        assert parts[rank] is not None and part_chunks(parts[rank]) <= stored_chunks(disks[node])
    # The shards of one node are not on the other (nobody asked for peer copies).
    assert not part_chunks(parts[0]) - part_chunks(parts[1]) & stored_chunks(disks["b"])

    # A restarted job restores on every node from that node's own disk, nothing else.
    assert run_ranks("nodes_restore", 2, work, base_config(), env=env) == [0, 0]
    for rank in range(2):
        out = rank_out(work, rank)
        assert out["restored_equal"] is True
        assert out["restored_report"] == {"disk": part_bytes(parts[rank])}
        restored = torch.load(work / f"restored{rank}.pt", weights_only=True)
        want = node_state(rank, 2)
        assert torch.equal(restored["shard"], want["shard"]) and torch.equal(restored["emb"], want["emb"])

    # verify on a node checks that node's part only: the other node's chunks are not "missing" here,
    # but a lost chunk of its own part is. The disk says whose part it holds, so a process that
    # names its node otherwise (a CLI run on the node without torchrun's variables) checks the same.
    own = sorted(part_chunks(parts[0]))
    with tiercache.open({"disk": {"path": str(disks["a"])}, "node": "a"}) as cache:
        assert cache.verify().ok
        (disks["a"] / chunk_key(own[0])).unlink()
        report = cache.verify()
    assert [(d.key, d.problem) for d in report.damage] == [(chunk_key(own[0]), "missing")]
    with tiercache.open({"disk": {"path": str(disks["a"])}, "node": "a-renamed"}) as cache:
        report = cache.verify()
    assert [(d.key, d.problem) for d in report.damage] == [(chunk_key(own[0]), "missing")]


@pytest.mark.parametrize("nodes", [["a", "b"], ["a", "a", "b", "b"]], ids=["2-ranks-2-nodes", "4-ranks-2-nodes"])
def test_peer_copies_restore_a_lost_node_without_s3(tmp_path: Path, s3_config: S3Config, nodes: list[str]) -> None:
    world = len(nodes)
    with ThrottledProxy(s3_config.endpoint_url or "") as relay:
        s3 = s3_config.model_copy(update={"endpoint_url": relay.url}).model_dump(mode="json")
        config = base_config(s3=s3, peers={"copies": 1})
        env = node_env(tmp_path, nodes)
        work = tmp_path / "work"
        assert run_ranks("nodes_save", world, work, config, env=env) == [0] * world
        outs = [rank_out(work, r) for r in range(world)]
        v2 = outs[0]["v2_levels"]["local"]
        for out in outs:
            assert out["v2_levels"] == {"local": v2, "replicated": v2, "remote": v2, "durable": v2}
            assert out["restored_equal"] is True
            assert set(out["restored_report"]) <= {"ram", "disk"}  # restored on each node from its own tiers
        disks = {n: tmp_path / f"disk-{n}" for n in "ab"}
        with tiercache.open({"disk": {"path": str(disks["a"])}}) as cache:
            version = cache.manifest("main")
        half = world // 2
        assert version.nodes == (NodePart(name="a", ranks=tuple(range(half)), copies=("b",)),
                                 NodePart(name="b", ranks=tuple(range(half, world)), copies=("a",)))
        # Each node holds its own part and, as the other's peer, the other's part.
        everything = {c.id for c in version.chunks}
        assert everything <= stored_chunks(disks["a"]) and everything <= stored_chunks(disks["b"])

        # Node b is lost with its disk; the job restarts on a replacement with an empty disk while
        # S3 refuses every connection.
        shutil.rmtree(disks["b"])
        relay.mode = "refuse"
        assert run_ranks("nodes_restore", world, work, config, env=env) == [0] * world
        for rank in range(world):
            out = rank_out(work, rank)
            assert out["restored_equal"] is True
            source = "disk" if rank < half else "peer"
            assert out["restored_report"] == {source: part_bytes(version, rank)}
            restored = torch.load(work / f"restored{rank}.pt", weights_only=True)
            assert torch.equal(restored["shard"], node_state(rank, 2)["shard"])


def test_the_default_policy_puts_every_group_version_on_every_node_and_in_s3(tmp_path: Path,
                                                                            s3_config: S3Config) -> None:
    # The default config (throughput-adaptive, no policy named), two nodes with their own disks and
    # S3, eight saves back to back: each rank's policy decides on its own (it may coalesce a version
    # away from S3 on one rank and not the other), yet every version is local on both nodes, the
    # ranks see the same outcome on each level, the newest is remote, and the history has no hole.
    config = {k: v for k, v in base_config(s3=s3_config.model_dump(mode="json")).items() if k != "policy"}
    work = tmp_path / "work"
    assert run_ranks("nodes_burst", 2, work, config, env=node_env(tmp_path, ["a", "b"])) == [0, 0]
    outs = [rank_out(work, r) for r in range(2)]
    versions = outs[0]["versions"]
    assert outs[1]["versions"] == versions and len(set(versions)) == 8
    assert outs[0]["levels"] == outs[1]["levels"]
    for vid, levels in zip(versions, outs[0]["levels"], strict=True):
        assert levels["local"] == levels["durable"] == vid
        assert levels["remote"] == vid or (levels["remote"][0] == "SkippedError" and "coalesced" in levels["remote"][1])
    assert outs[0]["levels"][-1]["remote"] == versions[-1]
    for out in outs:
        assert out["restored_equal"] is True
        assert out["history"] == versions[::-1]  # main~k is step 8-k: every version, in order
    for node in "ab":
        with tiercache.open({"disk": {"path": str(tmp_path / f"disk-{node}")}}) as cache:
            parents = {v.id: v.parent for v in cache.versions()}
        assert parents == dict(zip(versions, [None, *versions[:-1]], strict=True))


def test_a_group_keeps_saving_locally_while_s3_refuses(tmp_path: Path, s3_config: S3Config) -> None:
    # Default config, two nodes, S3 refusing every connection from the start: the ranks open
    # degraded, no save() raises, every version is local on both nodes, remote fails on every rank
    # with the same reason, and the newest restores bit-exact from the nodes' disks. When S3 is
    # back, a process on node a catches S3 up with what it holds whole (a single-process branch
    # and tag), and leaves the group's versions, of which it holds only its part, to the group.
    with ThrottledProxy(s3_config.endpoint_url or "") as relay:
        relay.mode = "refuse"
        s3 = s3_config.model_copy(update={"endpoint_url": relay.url}).model_dump(mode="json")
        on_a = {"disk": {"path": str(tmp_path / "disk-a")}, "s3": s3, "node": "a"}
        with tiercache.open(on_a) as cache:
            solo = cache.save(node_state(0, 9), step=9, branch="solo").wait("local")
            cache.tag("best", solo)
        config = {k: v for k, v in base_config(s3=s3).items() if k != "policy"}
        work = tmp_path / "work"
        assert run_ranks("nodes_s3_down", 2, work, config, env=node_env(tmp_path, ["a", "b"])) == [0, 0]
        outs = [rank_out(work, r) for r in range(2)]
        versions = outs[0]["versions"]
        assert [o["save_errors"] for o in outs] == [[], []] and len(versions) == 3
        assert outs[0]["levels"] == outs[1]["levels"]
        for vid, levels in zip(versions, outs[0]["levels"], strict=True):
            assert levels["local"] == levels["durable"] == vid
            assert levels["remote"][0] == "SkippedError"
            assert "s3 unavailable (TierUnavailableError" in levels["remote"][1]
        for out in outs:
            assert out["flush"] is None and out["restored_equal"] is True
            assert set(out["restored_report"]) <= {"ram", "disk"}

        relay.mode = "up"
        with tiercache.open(on_a) as cache:
            x = cache.save(node_state(0, 10), step=10, branch="x").wait("remote")
            deadline = time.monotonic() + 60
            # The catch-up runs on a thread of its own, started by the first save; the tag is its last ref.
            while core_of(cache).repo.catalog.ref_on("s3", "tag", "best") is None and time.monotonic() < deadline:
                time.sleep(0.05)
    with tiercache.open({"s3": s3_config.model_dump(mode="json")}) as bucket:
        assert bucket.refs() == {"branch/solo": solo, "tag/best": solo, "branch/x": x}
        assert {v.id for v in bucket.versions()} == {solo, x}


def test_a_peer_dying_mid_copy_fails_replicated_only_with_one_error(tmp_path: Path) -> None:
    env = node_env(tmp_path, ["a", "b", "c", "d"])
    work = tmp_path / "work"
    codes = run_ranks("peer_dies", 4, work, base_config(peers={"copies": 1}), env=env, opts={"timeout": 8})
    assert codes == [0, 0, 0, -9]
    outs = [rank_out(work, r) for r in range(3)]
    vid = outs[0]["levels"]["local"]
    errors = {tuple(o["levels"]["replicated"]) for o in outs}
    assert len(errors) == 1
    [(name, message)] = errors
    assert name == "GroupBrokenError" and vid in message and "peers" in message and "rank 3 (node d) is gone" in message
    for out in outs:
        assert out["levels"]["local"] == out["levels"]["durable"] == vid
        assert out["levels"]["remote"][0] == "ConfigError"
    # Every node, the dead one's included, committed the version before the copies started.
    for node in "abcd":
        assert (tmp_path / f"disk-{node}" / "versions" / f"{vid}.json").exists()


def test_four_replicas_restore_from_s3_reading_each_chunk_once(tmp_path: Path, s3_config: S3Config) -> None:
    with ThrottledProxy(s3_config.endpoint_url or "") as relay:
        s3 = s3_config.model_copy(update={"endpoint_url": relay.url})
        config = {"s3": s3.model_dump(mode="json"), "chunk_bytes": "1MiB", "pack_below": "16KiB",
                  "policy": {"name": "write-through"}}
        work = tmp_path / "work"
        assert run_ranks("ddp_save", 4, work, config) == [0, 0, 0, 0]
        with tiercache.open(config) as cache:
            cache.save(replica_state(0, 7), step=7, branch="single").wait("remote")
            stored = [cache.manifest("main"), cache.manifest("single")]
        one_copy = sum(c.nbytes for v in stored for c in v.chunks)
        before = relay.bytes_forwarded("down")
        assert run_ranks("ddp_restore", 4, work, config) == [0, 0, 0, 0]
        got = relay.bytes_forwarded("down") - before
    outs = [rank_out(work, r) for r in range(4)]
    assert all(o["main_equal"] and o["single_equal"] for o in outs)
    # Every chunk was read from S3 by exactly one rank and received by the others over the group.
    assert sum(o[k].get("s3", 0) for o in outs for k in ("main_report", "single_report")) == one_copy
    for o in outs:
        assert set(o["main_report"]) | set(o["single_report"]) <= {"s3", "peer"}
    # What S3 sent (chunks, manifests, listings, headers) stays near one copy of the state.
    assert one_copy <= got <= 1.1 * one_copy, (got, one_copy)


def test_no_rank_reads_another_ranks_part_to_save_a_version(tmp_path: Path, s3_config: S3Config) -> None:
    # Four ranks on two nodes, disk and S3: three versions reach every level, and no rank reads a
    # part manifest (its own or another rank's) from any tier: placement decides on what the rank
    # and the coordinator know (docs/integrations.md, "Metadata that scales").
    config = base_config(s3=s3_config.model_dump(mode="json"))
    work = tmp_path / "work"
    assert run_ranks("part_reads", 4, work, config, env=node_env(tmp_path, ["a", "a", "b", "b"])) == [0, 0, 0, 0]
    outs = [rank_out(work, r) for r in range(4)]
    for out in outs:
        assert [lv["durable"] for lv in out["levels"]] == [lv["durable"] for lv in outs[0]["levels"]]
        assert all(isinstance(lv["local"], str) and lv["remote"] == lv["local"] for lv in out["levels"])
    assert [o["reads"] for o in outs] == [[], [], [], []]


def test_a_hanging_s3_does_not_hold_a_group_versions_local(tmp_path: Path, s3_config: S3Config) -> None:
    # S3 hangs (connections accepted, never answered) after the first version: the next two still
    # reach `local` on both nodes, and no rank asked any tier for a part manifest meanwhile (it was
    # an S3 GET of the other ranks' parts, made by placement, that held `local` for minutes).
    with ThrottledProxy(s3_config.endpoint_url or "") as relay:
        s3 = s3_config.model_copy(update={"endpoint_url": relay.url, "connect_timeout": 1.0, "read_timeout": 2.0,
                                          "deadline_s": 4.0})
        work = tmp_path / "work"
        env = node_env(tmp_path, ["a", "b"])
        done: list[list[int]] = []
        ranks = threading.Thread(target=lambda: done.append(run_ranks(
            "part_reads", 2, work, base_config(s3=s3.model_dump(mode="json")), env=env,
            opts={"hang_s3_after": True})))
        ranks.start()
        deadline = time.monotonic() + 120
        while not all((work / f"ready{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        relay.mode = "hang"
        (work / "hang").touch()
        while not all((work / f"local{r}").exists() for r in range(2)) and ranks.is_alive():
            time.sleep(0.05)
        relay.mode = "up"  # (the ranks' uploads go on, so closing their caches is quick)
        ranks.join()
    assert done == [[0, 0]]
    outs = [rank_out(work, r) for r in range(2)]
    for out in outs:
        assert out["local"] == [None, None]
        assert out["reads"] == []


# ----------------------------------------------------------------------------- pure functions


def test_peers_are_chosen_across_failure_domains() -> None:
    # Two racks of three nodes: every node's copy goes to the other rack, each node holds one other part.
    topo = Topology.of([("n0", "r1"), ("n1", "r1"), ("n2", "r1"), ("n3", "r2"), ("n4", "r2"), ("n5", "r2")])
    peers = choose_peers(topo, 1)
    for node, chosen in enumerate(peers):
        assert len(chosen) == 1 and topo.domains[chosen[0]] != topo.domains[node]
    assert sorted(p for chosen in peers for p in chosen) == list(range(6))
    # Three racks, two copies: the three holders of every part are in three racks.
    topo = Topology.of([(f"n{i}", f"r{i % 3}") for i in range(6)])
    for node, chosen in enumerate(choose_peers(topo, 2)):
        assert len({topo.domains[n] for n in (node, *chosen)}) == 3
    # Without domains, nodes are their own: the next ones on the ring.
    topo = Topology.of([("a", ""), ("a", ""), ("b", ""), ("c", "")])
    assert topo.node_of == (0, 0, 1, 2) and topo.ranks(0) == (0, 1) and topo.leader(1) == 2
    assert choose_peers(topo, 1) == [(1,), (2,), (0,)]
    with pytest.raises(ConfigError, match="needs at least 4 nodes"):
        choose_peers(topo, 3)
    with pytest.raises(ConfigError, match="same TIERCACHE_FAILURE_DOMAIN"):
        Topology.of([("a", "r1"), ("a", "r2")])


def _version(chunks: list[tuple[str, int]]) -> Version:
    return Version(id="01J0000000000000000000000A", parent=None, branch="main", step=1, created_at=utcnow(),
                   chunks=tuple(ChunkRef(id=c, nbytes=n) for c, n in chunks), tensors=(), tree=["dict", {}], nbytes=0)


def test_copy_moves_send_what_a_peer_lacks_once_from_its_writer() -> None:
    a, b, c = ("a" * 32, "b" * 32, "c" * 32)
    topo = Topology.of([("n0", ""), ("n0", ""), ("n1", ""), ("n2", "")])
    version = _version([(a, 10), (b, 20), (c, 30)])
    writers = [{a: 0, b: 1}, {a: 2}, {c: 3}]
    moves = copy_moves(topo, [(1, 2), (2,), (0,)], writers, {c.id: c.nbytes for c in version.chunks})
    # n0's b goes to n1 and n2 from its writer, rank 1, read once; n1 holds a already, n2 lacks it;
    # n2's c goes to n0.
    assert moves == [Move(b, 20, 1, (2, 3)), Move(a, 10, 0, (3,)), Move(c, 30, 3, (0,))]
    # The ranks of a receiving node take turns.
    topo = Topology.of([("n0", ""), ("n1", ""), ("n1", "")])
    sizes = {c.id: c.nbytes for c in version.chunks}
    assert copy_moves(topo, [(1,), (0,)], [{a: 0, b: 0}, {}], sizes) == [Move(a, 10, 0, (1,)), Move(b, 20, 0, (2,))]


def test_restore_plan_reads_each_missing_chunk_once() -> None:
    a, b, c = ("a" * 32, "b" * 32, "c" * 32)
    version = _version([(a, 100), (b, 100), (c, 50)])
    # Four replicas need everything, nobody holds anything: one reader per chunk, spread.
    moves = plan_moves(version, [{a, b, c}] * 4, [set()] * 4)
    assert moves == [Move(a, 100, 0, (1, 2, 3)), Move(b, 100, 1, (0, 2, 3)), Move(c, 50, 2, (0, 1, 3))]
    # A lost node's rank 1 lacks its shard b, which rank 0 holds as a peer copy: rank 0 sends it.
    assert plan_moves(version, [set(), {b}], [{b}, set()]) == [Move(b, 100, 0, (1,))]
    # Batches: no rank receives more than the budget at once, yet a chunk over it still goes.
    assert [len(x) for x in batches(moves, 150)] == [1, 2]
    assert [len(x) for x in batches(moves, 50)] == [1, 1, 1]


def test_chunk_targets_and_a_single_process_cache_have_no_replicated_level(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        h = cache.save({"w": torch.arange(10.0)}, step=1)
        assert h.wait("local") == h.version
        with pytest.raises(ConfigError, match="'replicated' level"):
            h.wait("replicated")
        got = cache.restore("main")
        assert torch.equal(got["w"], torch.arange(10.0))
        assert cache.last_restore is not None and cache.last_restore.version == h.version
        assert cache.last_restore.nbytes == {"disk": 40}
        version = cache.manifest("main")
    dests = [empty_aligned((10,), torch.float32)]
    [targets] = chunk_targets(version, dests)
    assert list(zip(targets.offset.tolist(), targets.length.tolist(), strict=True)) == [(0, 40)]
    assert targets.addr.tolist() == [dests[0].data_ptr()]
    assert chunk_key(version.chunks[0].id).startswith("chunks/")


def test_the_cli_lists_verifies_and_restores_a_multi_node_cache_from_one_process(tmp_path: Path,
                                                                                 s3_config: S3Config) -> None:
    from typer.testing import CliRunner

    from tiercache.cli import app

    env = node_env(tmp_path, ["a", "b"])
    work = tmp_path / "work"
    s3 = s3_config.model_dump(mode="json")
    assert run_ranks("nodes_save", 2, work, base_config(s3=s3), env=env) == [0, 0]
    v1, v2 = (rank_out(work, 0)[f"v{i}_levels"]["local"] for i in (1, 2))

    def cli(config: dict[str, Any], *args: str) -> Any:
        path = tmp_path / "cli.toml"
        path.write_text("".join(f"[{table}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()
                                                         if v is not None and not isinstance(v, dict))
                                for table, fields in config.items()))
        return CliRunner().invoke(app, ["--config", str(path), *args])

    # From S3, which holds every rank's part: the whole version, as the list of the ranks' states.
    on_s3 = {"s3": s3}
    listed = cli(on_s3, "ls", "--json")
    assert listed.exit_code == 0, listed.output
    assert [(v["id"], v["step"]) for v in json.loads(listed.stdout)] == [(v1, 1), (v2, 2)]
    assert cli(on_s3, "verify").exit_code == 0
    out = tmp_path / "whole.pt"
    assert cli(on_s3, "restore", "main", "--out", str(out)).exit_code == 0
    whole = torch.load(out, weights_only=True)
    for rank in range(2):
        assert torch.equal(whole[rank]["shard"], node_state(rank, 2)["shard"])
    # From one node's disk: it lists and verifies what it holds; a restore of the whole version says
    # which parts it lacks, in one line.
    on_a = {"disk": {"path": str(tmp_path / "disk-a")}}
    listed = cli(on_a, "ls", "--json")
    assert listed.exit_code == 0 and [v["id"] for v in json.loads(listed.stdout)] == [v1, v2]
    assert cli(on_a, "verify").exit_code == 0
    refused = cli(on_a, "restore", "main", "--out", str(tmp_path / "part.pt"))
    assert refused.exit_code != 0 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "parts of ranks 1 are on no tier" in refused.stderr



def _lose_a_part(disk: Path, vid: str) -> str:
    (disk / part_key(vid, 1)).unlink()
    return f"rank 0 (node a): IntegrityError: the parts of ranks 1 of version {vid} are on no tier and no node"


def _garble_a_part(disk: Path, vid: str) -> str:
    (disk / part_key(vid, 1)).write_bytes(b'{"not": "a part"}')
    return f"rank 1 (node b): IntegrityError: rank 1's part of version {vid} (from a peer) is not a valid tiercache"


def _damage_a_chunk(disk: Path, vid: str) -> str:
    with tiercache.open({"disk": {"path": str(disk)}}) as cache:
        version = cache.manifest(vid)
    chunk = sorted(part_chunks(version, 1) - part_chunks(version, 0))[0]  # only rank 1 reads it
    path = disk / chunk_key(chunk)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    # The rank that holds the copy reads it for the needer, finds it damaged, and says so.
    return f"rank 0 (node a): IntegrityError: chunk {chunk} has no good copy on any tier"


def test_a_lost_node_restored_from_a_bad_peer_copy_fails_every_rank_alike(tmp_path: Path) -> None:
    """Node b is lost, there is no S3, and node a's peer copy of b's part is gone or damaged.

    Every rank fails the restore with the same error, naming the rank that found the fault, in
    the phase where the copy is needed: the part no node holds (``offer``), a bad part sent by the
    peer (``delivered``), a damaged chunk the peer reads for the needer (``done``). None waits for
    the group's timeout.
    """
    env = node_env(tmp_path, ["a", "b"])
    work = tmp_path / "work"
    config = base_config(peers={"copies": 1})
    assert run_ranks("nodes_save", 2, work, config, env=env) == [0, 0]
    vid = rank_out(work, 0)["v2_levels"]["local"]
    shutil.rmtree(tmp_path / "disk-b")
    saved = tmp_path / "disk-a-saved"
    shutil.copytree(tmp_path / "disk-a", saved)
    for damage in (_lose_a_part, _garble_a_part, _damage_a_chunk):
        shutil.rmtree(tmp_path / "disk-a")
        shutil.copytree(saved, tmp_path / "disk-a")
        want = damage(tmp_path / "disk-a", vid)
        assert run_ranks("nodes_restore_fails", 2, work, config, env=env, opts={"timeout": 60}) == [0, 0]
        outs = [rank_out(work, r) for r in range(2)]
        assert outs[0]["error"] == outs[1]["error"], (damage.__name__, outs)
        name, message = outs[0]["error"]
        assert name == "IntegrityError" and message.startswith(f"the group's restore of 'main' failed: {want}"), message
        assert all(o["seconds"] < 30 for o in outs), outs  # learnt in that phase, not at the 60 s timeout
        shutil.rmtree(tmp_path / "disk-b", ignore_errors=True)  # the failed restore made a fresh one


@pytest.mark.parametrize(("kind", "rank"), [("raise", 0), ("raise", 1), ("sleep", 1), ("kill", 0)])
def test_a_rank_failing_where_the_nodes_say_what_they_hold_fails_the_restore_on_every_rank(
    tmp_path: Path, kind: str, rank: int
) -> None:
    """Node b is lost and its part must come from node a's peer copy: the ``holding`` phase runs.

    One rank raises there, stalls past the group's timeout, or is SIGKILLed (rank 0 also
    coordinates). Every other rank fails the restore with the same error, naming that rank, in
    that phase: at once when it raises or dies, at the group's timeout when it stalls.
    """
    env = node_env(tmp_path, ["a", "b"])
    work = tmp_path / "work"
    config = base_config(peers={"copies": 1})
    assert run_ranks("nodes_save", 2, work, config, env=env) == [0, 0]
    shutil.rmtree(tmp_path / "disk-b")
    timeout = 4.0
    store = dist.TCPStore("127.0.0.1", free_port(), 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    codes = run_ranks("nodes_restore_fault", 2, work, config, env=env,
                      opts={"fault": {"rank": rank, "kind": kind, "seconds": timeout + 3}, "timeout": timeout,
                            "store": store.port, "broken": kind == "kill"})
    assert codes == [-9 if r == rank and kind == "kill" else 0 for r in range(2)]
    outs = {r: rank_out(work, r) for r in range(2) if codes[r] == 0}
    errors = {tuple(o["error"]) for o in outs.values()}
    assert len(errors) == 1, outs
    [(name, message)] = errors
    failed = f"the group's restore of 'main' failed: rank {rank} (node {'ab'[rank]})"
    if kind == "raise":
        assert (name, message) == ("StorageError", f"{failed}: StorageError: injected at restore/0/holding")
    elif kind == "sleep":
        assert message == f"{failed} did not answer within {timeout:g}s"
    else:
        assert message.startswith(f"{failed} is gone (no heartbeat for "), message
    other = outs[1 - rank]["seconds"]
    assert other < (2 * timeout + 5 if kind == "sleep" else timeout), outs
