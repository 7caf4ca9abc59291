"""Multi-rank save and restore (tiercache.group): 2 and 4 gloo ranks on CPU, all three tiers.

Every rank is a forked process (``_multirank_worker.py``) with its own cache on one shared disk
directory (a node-local cache) and one S3 prefix on the real local S3 server. The test then opens
each durable tier alone, in this process, and checks what was committed there, bit for bit.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _multirank_worker import ddp_state, forked, full_tensors, rank_err_path

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import GroupSaveError, IntegrityError
from tiercache.group.owners import assign_owners
from tiercache.group.round import Round
from tiercache.manifest import ChunkRef, Piece, RefRecord, TensorEntry, Version, utcnow
from tiercache.names import chunk_key
from tiercache.parts import group_header, merge, part_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    scenario: str, world: int, work: Path, config: dict[str, Any], timeout: float = 120,
    env: list[dict[str, str]] | None = None, opts: dict[str, Any] | None = None,
) -> list[int]:
    """Run ``scenario`` on ``world`` ranks; return their exit codes (-9: killed).

    ``env`` gives each rank environment variables of its own (its node, its disk directory);
    ``opts`` is the ranks' ``run.json`` (see ``_multirank_worker.run``).

    The ranks are forked by a fork server that imported torch and tiercache once for the whole
    session: spawning would cost each rank many seconds of imports on a loaded machine, and
    forking this process (whose torch may have started OpenMP threads) can deadlock the child.
    """
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(config))
    (work / "run.json").write_text(json.dumps(opts or {}))
    # The fork server keeps the environment of the test that started it: pass the S3 server's
    # credentials (set by the s3_server fixture, maybe after that) with each rank's own variables.
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    (work / "env.json").write_text(json.dumps([{**aws, **(env[r] if env else {})} for r in range(world)]))
    port = free_port()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the host's external address
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "tiercache.group", "_multirank_worker",
                                "_chaos_worker", "_faults_worker"])
    procs = [ctx.Process(target=forked, args=(scenario, r, world, port, work)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _err_tail(work: Path, rank: int) -> str:
    err = rank_err_path(work, rank)
    return err.read_text(errors="replace")[-3000:] if err.exists() else "(no stderr)"


def rank_errs(work: Path, world: int) -> str:
    """The end of each rank's stderr of a run in ``work`` (for a failure's message)."""
    return "\n".join(f"rank {rank}'s stderr ends:\n{_err_tail(work, rank)}" for rank in range(world))


def rank_out(work: Path, rank: int, key: str | None = None) -> dict[str, Any]:
    """What rank ``rank`` of a run in ``work`` wrote; with ``key``, it must hold that key.

    A rank that wrote nothing, or no ``key``, fails the test with what it wrote and the end of its stderr.
    """
    path = work / f"rank{rank}.json"
    out = json.loads(path.read_text()) if path.exists() else None
    if out is None or (key is not None and key not in out):
        raise AssertionError(f"rank {rank} wrote {out if out is not None else 'nothing'}; "
                             f"its stderr ends:\n{_err_tail(work, rank)}")
    return out


def cache_config(tmp_path: Path, s3_config: S3Config) -> dict[str, Any]:
    return {
        "disk": {"path": str(tmp_path / "disk")},
        "s3": s3_config.model_dump(mode="json"),
        "ram": {"capacity": "16MiB"},
        "chunk_bytes": "1MiB",
        "pack_below": "16KiB",
        "policy": {"name": "write-through"},
    }


def one_tier(config: dict[str, Any], tier: str) -> tiercache.TierCache:
    """A cache on just one durable tier of ``config``, to check what that tier holds."""
    return tiercache.open({tier: config[tier]})


def assert_state_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_state_equal(got[k], want[k])
    else:
        assert got == want


def test_ddp_two_ranks_all_tiers_dedup_failure_and_restore(tmp_path: Path, s3_config: S3Config) -> None:
    config = cache_config(tmp_path, s3_config)
    work = tmp_path / "work"
    assert run_ranks("ddp", 2, work, config) == [0, 0]
    r0, r1 = rank_out(work, 0), rank_out(work, 1)
    assert (r0["v1"], r0["v2"], r0["v3"]) == (r1["v1"], r1["v2"], r1["v3"])
    assert r0["remote"] == r1["remote"] == [r0["v1"], r0["v2"]]
    assert r0["into_in_place"] is True and r1["into_in_place"] is True

    # The replicated weight (256 KiB) was split into two 128 KiB chunks, one written by each rank,
    # and no chunk was written by both ranks to the same tier.
    puts0, puts1 = set(r0["puts"]), set(r1["puts"])
    assert puts0 and puts1 and not puts0 & puts1

    # A failure on rank 1 failed version 3 on every rank with the same error; nothing committed.
    assert r0["v3_errors"] == r1["v3_errors"]
    for lvl in ("local", "remote", "durable"):
        name, message = r0["v3_errors"][lvl]
        assert name == "GroupSaveError"
        assert r0["v3"] in message and "rank 1" in message and "injected: disk full on rank 1" in message

    # In the ranks' own view the branch moved to version 3 when it was saved, as in a single-process
    # save, and back to version 2 when the group failed it: "main" restores version 2.
    assert r0["head"] == r1["head"] == r0["v2"]

    for tier in ("disk", "s3"):
        with one_tier(config, tier) as cache:
            assert cache.resolve("main") == r0["v2"]
            v2 = cache.manifest("main")
            assert v2.parent == r0["v1"] and v2.step == 2 and len(v2.parts) == 2
            assert cache.manifest(r0["v1"]).meta == {"loss": 1.5}
            assert r0["v3"] not in {v.id for v in cache.versions()}
            # Replicated chunks are stored once: both ranks' tables name the same weight chunks.
            w0 = next(t for t in v2.tensors if t.path == "0/model/w")
            w1 = next(t for t in v2.tensors if t.path == "1/model/w")
            assert [p.chunk for p in w0.pieces] == [p.chunk for p in w1.pieces] and len(w0.pieces) == 2
            # Restored in one process, a multi-rank version is the list of the ranks' states.
            whole = cache.restore("main")
            assert len(whole) == 2
            for rank in range(2):
                assert_state_equal(whole[rank], ddp_state(rank, 2))

    for rank in range(2):
        restored = torch.load(work / f"restored{rank}.pt", weights_only=True)
        assert_state_equal(restored["main"], ddp_state(rank, 2))
        assert_state_equal(restored["v1_into"], ddp_state(rank, 1))


def test_declared_replicated_chunks_are_hashed_on_every_rank_and_written_once_in_the_group(
    tmp_path: Path, s3_config: S3Config
) -> None:
    config = cache_config(tmp_path, s3_config)
    work = tmp_path / "work"
    assert run_ranks("ddp_declared", 2, work, config) == [0, 0]
    r0, r1 = rank_out(work, 0), rank_out(work, 1)
    assert r0["v1"] == r1["v1"] == r0["remote"] and r0["restored_equal"] and r1["restored_equal"]
    with one_tier(config, "s3") as cache:
        version = cache.manifest("main")
        whole = cache.restore("main")  # every chunk verified against its id: the traded ids are right
    for rank in range(2):
        assert_state_equal(whole[rank], ddp_state(rank, 1))
    # Every rank hashed the whole weight (256 KiB, two chunks), so the ranks could compare its ids,
    # and its own pack of small tensors (the bias and its rng).
    w = next(t for t in version.tensors if t.path == "0/model/w")
    packs = [next(t for t in version.tensors if t.path == f"{r}/rng").pieces[0].chunk for r in range(2)]
    assert len(w.pieces) == 2 and len(set(packs)) == 2
    for rank, out in enumerate((r0, r1)):
        assert out["hashed"] == 256 * 1024 + version.chunks[packs[rank]].nbytes
    # Each weight chunk was written to each tier by its owner, and by no other.
    w_keys = {chunk_key(version.chunks[p.chunk].id) for p in w.pieces}
    for tier in ("disk", "s3"):
        mine = [{k.split(":", 1)[1] for k in out["puts"] if k.startswith(tier)} & w_keys for out in (r0, r1)]
        assert len(mine[0]) == len(mine[1]) == 1 and mine[0] != mine[1]


def test_a_rank_throttled_by_s3_slows_every_rank_down(tmp_path: Path, s3_config: S3Config) -> None:
    config = cache_config(tmp_path, s3_config)
    config["s3"]["max_attempts"] = 1  # the pacer does the retrying, with short waits
    work = tmp_path / "work"
    assert run_ranks("throttled", 2, work, config) == [0, 0]
    r0, r1 = rank_out(work, 0), rank_out(work, 1)
    assert r0["remote"] and r1["remote"] and r0["restored_equal"] and r1["restored_equal"]
    # Both ranks run on this machine's one node: they share s3.max_concurrency (8).
    assert r0["limit_before"] == r1["limit_before"] == 4
    assert (r1["answered"], r1["throttled"], r0["throttled"]) == (2, 2, 0)
    # Rank 1 halved its writes in flight on each SlowDown; rank 0, never throttled, halved its own
    # once when the group learnt of it (4 -> 2), and its commit's puts since (the manifest, the
    # probe record for doctor) may have raised it by one.
    assert r1["limit_after"] < 4 and r0["limit_after"] in (2, 3)


def test_rank_killed_mid_save_commits_nothing(tmp_path: Path, s3_config: S3Config) -> None:
    config = cache_config(tmp_path, s3_config)
    work = tmp_path / "work"
    assert run_ranks("kill", 2, work, config, opts={"timeout": 8}) == [0, -9]  # rank 1 is gone after 6 s
    r0 = rank_out(work, 0)
    for lvl in ("local", "remote", "durable"):
        name, message = r0["v2_errors"][lvl]
        # The phase that found rank 1 gone names the version; later phases of it failed at once.
        assert name == "GroupBrokenError" and "rank 1 is gone" in message
    for tier in ("disk", "s3"):
        with one_tier(config, tier) as cache:
            assert cache.resolve("main") == r0["v1"]
            assert r0["v2"] not in {v.id for v in cache.versions()}
            whole = cache.restore("main")
            for rank in range(2):
                assert_state_equal(whole[rank], ddp_state(rank, 1))


def test_sharded_dtensor_four_ranks(tmp_path: Path, s3_config: S3Config) -> None:
    config = cache_config(tmp_path, s3_config)
    work = tmp_path / "work"
    assert run_ranks("sharded", 4, work, config) == [0, 0, 0, 0]
    outs = [rank_out(work, r) for r in range(4)]
    assert len({o["v1"] for o in outs}) == 1
    assert all(o["restored_equal"] == {"w": True, "emb": True} for o in outs)
    full = full_tensors(1)
    for r in range(4):
        local = torch.load(work / f"restored{r}.pt", weights_only=True)
        assert torch.equal(local["w"], full["w"][16 * r : 16 * (r + 1)])
    with one_tier(config, "s3") as cache:
        version = cache.manifest("main")
        assert len(version.parts) == 4
        # The replicated 96 KiB embedding is one set of chunks shared by the four ranks' tables.
        embs = [next(t for t in version.tensors if t.path == f"{r}/emb") for r in range(4)]
        assert len({tuple(p.chunk for p in e.pieces) for e in embs}) == 1
        whole = cache.restore("main")
        assert torch.cat([whole[r]["w"] for r in range(4)]).equal(full["w"])


def test_node_local_disk_shared_by_four_processes(tmp_path: Path) -> None:
    config = {"disk": {"path": str(tmp_path / "disk")}}
    work = tmp_path / "work"
    assert run_ranks("shared_disk", 4, work, config) == [0, 0, 0, 0]
    disk = tmp_path / "disk"
    assert (disk / "chunks" / "ab" / ("ab" * 16)).read_bytes() == bytes(range(256)) * 4096
    assert not list(disk.rglob(".tmp-*"))
    # 4 processes x 10 compare-and-swap increments of one ref: none lost.
    with tiercache.open(config) as cache:
        assert core_of(cache).repo.durable["disk"].read_ref("refs/branch/shared").data == b"40"


# ----------------------------------------------------------------------------- pure functions


def _part(rank: int, chunks: list[tuple[str, int]]) -> Version:
    tensors = tuple(
        TensorEntry(path=f"t{i}", dtype="uint8", shape=(n,), nbytes=n, pieces=(Piece(chunk=i, chunk_offset=0,
                                                                                    offset=0, nbytes=n),))
        for i, (_, n) in enumerate(chunks)
    )
    tree = ["dict", {f"t{i}": ["t", i] for i in range(len(chunks))}]
    return Version(id="01J0000000000000000000000A", parent=None, branch="main", step=1, created_at=utcnow(),
                   chunks=tuple(ChunkRef(id=c, nbytes=n) for c, n in chunks), tensors=tensors, tree=tree,
                   nbytes=sum(n for _, n in chunks))


def test_owners_split_shared_chunks_and_keep_own_ones() -> None:
    a, b, c, d, own0, own1 = (f"{i:032x}" for i in range(1, 7))
    parts = [_part(0, [(a, 100), (b, 100), (c, 100), (d, 100), (own0, 10)]),
             _part(1, [(a, 100), (b, 100), (c, 100), (d, 100), (own1, 10)])]
    owned = assign_owners([[(ch.id, ch.nbytes) for ch in p.chunks] for p in parts])
    assert owned == [{own0, a, c}, {own1, b, d}]
    header = group_header(id=parts[0].id, parent=None, branch="main", step=1, created_at=utcnow(), meta={},
                          hash_algo="xxh3-128", ranks=2, nbytes=820)
    merged = merge(header, [part_of(p, r) for r, p in enumerate(parts)])
    assert [ch.id for ch in merged.chunks] == [a, b, c, d, own0, own1]
    assert [t.path for t in merged.tensors][5:] == ["1/t0", "1/t1", "1/t2", "1/t3", "1/t4"]
    assert merged.tensors[9].pieces[0].chunk == 5
    assert merged.tree[2] == ["dict", {f"t{i}": ["t", 5 + i] for i in range(5)}]
    assert [(p.first, p.count) for p in merged.parts] == [(0, 5), (5, 5)]
    # Stored, the merged version is its group manifest: no rank's table in it.
    assert Version.from_json(merged.to_json()) == header


def test_merge_refuses_parts_that_do_not_add_up_to_the_group_manifest() -> None:
    p0 = _part(0, [("a" * 32, 4)])
    header = group_header(id=p0.id, parent=None, branch="main", step=1, created_at=utcnow(), meta={},
                          hash_algo="xxh3-128", ranks=2, nbytes=8)
    with pytest.raises(IntegrityError, match="do not add up"):
        merge(header, [part_of(p0, 0)])


def test_durable_fails_with_the_first_failed_tier_in_tier_order_whatever_settles_first() -> None:
    # Each rank settles its tiers in the order their phases finish, which differs between ranks;
    # the durable error must not, or the ranks report different errors for one version.
    # The version leaves its branch in this process's view before anyone hears durable failed:
    # a trainer reading the head right after wait("durable") raised must not find it there.
    retracted: list[tuple[RefRecord, bool]] = []
    catalog = SimpleNamespace(retract=lambda rec: retracted.append((rec, rnd.futures["durable"].done())))
    view = SimpleNamespace(core=SimpleNamespace(repo=SimpleNamespace(durable={"disk": None, "s3": None}),
                                                catalog=catalog), nodes=())
    ref = RefRecord(kind="branch", name="main", version="v", seq=0)
    rnd = Round(view, "v", ref, step=1,  # type: ignore[arg-type]
                parent=None, created_at=utcnow(), meta={}, trade=False, declared=())
    on_disk, on_s3 = GroupSaveError("failed on disk"), GroupSaveError("failed on s3")
    rnd.settle("s3", on_s3)
    assert retracted == []  # the disk may still commit it
    rnd.settle("disk", on_disk)
    assert rnd.futures["durable"].exception() is on_disk
    assert rnd.futures["remote"].exception() is on_s3 and rnd.futures["local"].exception() is on_disk
    assert retracted == [(ref, False)]


def test_durable_holds_when_one_tier_commits_while_another_tier_fails_on_another_thread() -> None:
    # The disk and S3 verdicts settle on two phase threads. When S3's failure read both tiers
    # settled before the disk's success reached the durable level, `durable` failed (and the
    # version left its branch) though the disk committed it: rank 1 of a CI run reported durable
    # failed while rank 0 reported it durable. The interleaving is forced here: the disk settles
    # from inside S3's settle, and holds in its note of the missed tier until S3's settle is done.
    in_note, s3_done = threading.Event(), threading.Event()
    retracted: list[RefRecord] = []

    def note_outcomes(vid: str, outcomes: dict[str, Any]) -> None:
        in_note.set()
        assert s3_done.wait(10)

    catalog = SimpleNamespace(retract=retracted.append, note_outcomes=note_outcomes,
                              store_outcomes=lambda vid, on: None)
    view = SimpleNamespace(core=SimpleNamespace(repo=SimpleNamespace(durable={"disk": None, "s3": None}),
                                                catalog=catalog), nodes=(), rank=0, node_local=frozenset({"disk"}),
                           topology=SimpleNamespace(leads=lambda rank: True))
    ref = RefRecord(kind="branch", name="main", version="v", seq=0)
    rnd = Round(view, "v", ref, step=1,  # type: ignore[arg-type]
                parent=None, created_at=utcnow(), meta={}, trade=False, declared=())
    disk = threading.Thread(target=rnd.settle, args=("disk", None))
    rnd.outcome["s3"].add_done_callback(lambda f: (disk.start(), in_note.wait(10)))
    on_s3 = GroupSaveError("failed on s3")
    rnd.settle("s3", on_s3)
    s3_done.set()
    disk.join(10)
    assert rnd.futures["durable"].result(timeout=0) == "v" and rnd.futures["local"].result(timeout=0) == "v"
    assert rnd.futures["remote"].exception() is on_s3
    assert retracted == []


def test_a_tier_verdict_is_given_once_and_a_later_fail_all_leaves_a_committed_tier_committed() -> None:
    # A phase that raises after its tier's verdict (a bug) makes its worker fail the version's
    # levels (fail_all): the tier the group committed must stay committed, the version its
    # branch's head and not counted lost (before, the disk's verdict was overwritten and the
    # version counted lost: flush() would raise its loss though the disk holds it).
    retracted: list[RefRecord] = []
    lost: list[tuple[Any, ...]] = []
    catalog = SimpleNamespace(retract=retracted.append, note_outcomes=lambda vid, outcomes: None,
                              store_outcomes=lambda vid, on: None)
    core = SimpleNamespace(repo=SimpleNamespace(durable={"disk": None, "s3": None}), catalog=catalog,
                           saver=SimpleNamespace(record_loss=lambda *args: lost.append(args)))
    view = SimpleNamespace(core=core, nodes=(), rank=0, node_local=frozenset({"disk"}),
                           topology=SimpleNamespace(leads=lambda rank: True))
    ref = RefRecord(kind="branch", name="main", version="v", seq=0)
    rnd = Round(view, "v", ref, step=1,  # type: ignore[arg-type]
                parent=None, created_at=utcnow(), meta={}, trade=False, declared=())
    rnd.local = SimpleNamespace()  # type: ignore[assignment]  # a version this rank staged
    rnd.settle("disk", None)
    bug = RuntimeError("a phase raised after its verdict")
    rnd.fail_all(bug)
    assert rnd.futures["local"].result(timeout=0) == "v" and rnd.futures["durable"].result(timeout=0) == "v"
    assert rnd.futures["remote"].exception() is bug
    assert retracted == [] and lost == []

    # A settle that raised before it resolved its tier's level (its note for humans failed)
    # leaves the level to the worker's fail_all: nothing stays pending.
    def note_fails(vid: str, outcomes: Any) -> None:
        raise RuntimeError("the note failed")

    catalog.note_outcomes = note_fails
    rnd = Round(view, "w", ref, step=2,  # type: ignore[arg-type]
                parent=None, created_at=utcnow(), meta={}, trade=False, declared=())
    rnd.settle("s3", GroupSaveError("failed on s3"))
    with pytest.raises(RuntimeError, match="the note failed"):
        rnd.settle("disk", None)
    rnd.fail_all(bug)
    assert rnd.futures["local"].exception(timeout=0) is bug and rnd.futures["durable"].exception(timeout=0) is bug


def test_declared_chunks_are_those_holding_only_declared_tensors() -> None:
    from tiercache.group.hashing import declared_chunks, owners_by_position
    from tiercache.layout import plan_layout

    # model/w: 3 chunks of 64 KiB; model/b and rng (small) share one pack chunk.
    layout = plan_layout([192 << 10, 1024, 32], [4, 4, 8], chunk_bytes=64 << 10, pack_below=16 << 10)
    paths = ["model/w", "model/b", "rng"]
    shared = declared_chunks(layout, paths, ["model"])
    assert [pos for pos, _ in shared] == [i for i, c in enumerate(layout.chunks) if not c.packed]
    assert declared_chunks(layout, paths, ["model/"]) == shared and declared_chunks(layout, paths, ["mod"]) == []
    assert len(declared_chunks(layout, paths, ["model", "rng"])) == len(layout.chunks)
    assert owners_by_position([(0, 10), (1, 10), (2, 10), (3, 5)], 2) == {0: 0, 1: 1, 2: 0, 3: 1}


@pytest.mark.parametrize("nodes", [["a", "a"], ["a", "b"]], ids=["one-node", "two-nodes"])
@pytest.mark.parametrize("s3", [True, False], ids=["s3", "no-s3"])
def test_a_declared_replica_that_differs_fails_its_version_on_every_rank(
    tmp_path: Path, s3_config: S3Config, nodes: list[str], s3: bool
) -> None:
    # Rank 1 adds 1 to model.w at step 2 although the model is declared replicated. Before, every
    # level of that version was ok: on two nodes its chunks were rank 1's bytes under rank 0's ids
    # (IntegrityError at restore), on one node or S3 a restore mixed the ranks' rows.
    config = cache_config(tmp_path, s3_config)
    if not s3:
        del config["s3"]
    env = [{"TIERCACHE_NODE": n, "TIERCACHE_DISK__PATH": str(tmp_path / f"disk-{n}")} for n in nodes]
    work = tmp_path / "work"
    assert run_ranks("replica_differs", 2, work, config, env=env) == [0, 0]
    r0, r1 = rank_out(work, 0), rank_out(work, 1)
    v1, v2, v3 = r0["versions"]
    assert r1["versions"] == r0["versions"]
    message = (f"version {v2} at hashing failed: tensors ['model/w'] were declared replicated but ranks [1] hold "
               f"other bytes than rank 0; declare replicated= only for state that is the same on every rank")
    for out in (r0, r1):
        assert out["levels"] == [{"local": None, "durable": None},
                                 {"local": ["GroupSaveError", message], "durable": ["GroupSaveError", message]},
                                 {"local": None, "durable": None}]
        assert out["head"] == v3 and out["restored_equal"] is True
    # Nothing of version 2 was committed on any tier; the next version restores bit-exact from each
    # tier that holds every rank's part (a node's own disk holds its own ranks' parts only).
    tiers = [{"disk": {"path": str(tmp_path / f"disk-{n}")}} for n in sorted(set(nodes))]
    tiers += [{"s3": config["s3"]}] if s3 else []
    for tier in tiers:
        with tiercache.open(tier) as cache:
            assert v2 not in {v.id for v in cache.versions()}
            assert cache.manifest("main").parent == v1
            if "s3" in tier or len(set(nodes)) == 1:
                whole = cache.restore("main")
                for rank in range(2):
                    assert_state_equal(whole[rank], ddp_state(rank, 3))
