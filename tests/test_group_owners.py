"""Who writes which chunk (tiercache.group.owners), and each rank's slots (tiercache.group.transfer).

The coordinator's decisions are checked against plain restatements of their rules on random
groups: duplicate ids within a rank, chunks shared by some ranks, preset writers on and off the
node, one node or several.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from tiercache.group.owners import assign_owners, plan_parts, writers_by_node
from tiercache.group.topology import Topology
from tiercache.group.transfer import Move, Slot, batches, by_rank, own, schedule, shares


def reference_owners(chunks: Sequence[Sequence[tuple[str, int]]], preset: Mapping[str, int]) -> list[set[str]]:
    """The rule, stated plainly: a rank's own chunks are its; a shared one goes to its preset writer
    if that rank holds it, else to the holder with the fewest bytes so far (then the lowest rank),
    in the order the chunks are first named."""
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, own_chunks in enumerate(chunks):
        for cid, n in own_chunks:
            holders.setdefault(cid, [])
            if rank not in holders[cid]:
                holders[cid].append(rank)
            size[cid] = n
    owned: list[set[str]] = [set() for _ in chunks]
    load = [0] * len(chunks)
    for single in (True, False):
        for cid, ranks in holders.items():
            if (len(ranks) == 1) != single:
                continue
            rank = preset[cid] if preset.get(cid) in ranks else min(ranks, key=lambda r: (load[r], r))
            owned[rank].add(cid)
            load[rank] += size[cid]
    return owned


def random_group(rng: random.Random) -> tuple[list[dict], Topology, dict[str, int]]:
    world = rng.randint(1, 12)
    per_node = rng.randint(1, 4)
    topo = Topology.of([(f"n{r // per_node}", "") for r in range(world)])
    pool = [f"{i:032x}" for i in range(1, rng.randint(2, 24))]
    parts = []
    for _ in range(world):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        parts.append({"chunks": [[c, int(c, 16) % 5 * 100 + 1] for c in ids], "nbytes": 7, "part": 11})
    preset = {c: rng.randrange(world) for c in rng.sample(pool, rng.randint(0, len(pool)))}
    return parts, topo, preset


@pytest.mark.parametrize("seed", range(4))
def test_plan_parts_follows_the_rule_on_every_tier_and_node(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        parts, topo, preset = random_group(rng)
        chunks = [[(c, n) for c, n in p["chunks"]] for p in parts]
        plan = plan_parts(parts, ["disk", "s3"], {"disk"}, topo, preset)
        assert assign_owners(chunks, preset) == reference_owners(chunks, preset)
        # S3: every distinct chunk of the group once, by a rank that holds it.
        s3 = [{chunks[r][i][0] for i in plan.per_rank[r]["s3"]} for r in range(len(parts))]
        assert s3 == reference_owners(chunks, preset)
        # Each node's disk: every chunk its ranks hold once, split among them by the same rule.
        expected: list[dict[str, int]] = []
        for node in range(topo.count):
            ranks = topo.ranks(node)
            local = {c: ranks.index(r) for c, r in preset.items() if r in ranks}
            owned = reference_owners([chunks[r] for r in ranks], local)
            expected.append({c: ranks[i] for i, ids in enumerate(owned) for c in ids})
        assert plan.writers == expected == writers_by_node(chunks, topo, preset)
        for r in range(len(parts)):
            positions = plan.per_rank[r]["disk"]
            assert positions == sorted(set(positions))  # each chunk once, in layout order
            assert {chunks[r][i][0] for i in positions} == {c for c, w in expected[topo.node_of[r]].items() if w == r}
        assert plan.sizes == {c: n for own_chunks in chunks for c, n in own_chunks}
        assert (plan.nbytes, plan.part_bytes) == (7 * len(parts), [11] * len(parts))


def test_a_replicated_tensor_is_written_slice_by_slice_in_a_large_group() -> None:
    world = 4096
    topo = Topology.of([(f"n{r // 8}", "") for r in range(world)])
    replica = [f"{i + 1:032x}" for i in range(16)]  # a tensor the first 16 ranks hold, one slice per rank
    parts = [{"chunks": [[c, 1 << 20] for c in replica] if r < 16 else [[f"{r + 1:031x}f", 4096]],
              "nbytes": 1, "part": 1} for r in range(world)]
    plan = plan_parts(parts, ["disk", "s3"], {"disk"}, topo)
    assert [p["s3"] for p in plan.per_rank[:16]] == [[r] for r in range(16)]  # slice r by rank r (FastPersist)
    assert all(p["s3"] == [0] for p in plan.per_rank[16:])
    assert sum(len(p["s3"]) for p in plan.per_rank) == len(plan.sizes) == 16 + world - 16
    # Each of the two nodes holding the tensor writes all of it to its disk, split over its 8 ranks.
    assert [len(p["disk"]) for p in plan.per_rank[:16]] == [2] * 16


def test_by_rank_gives_every_rank_what_own_gives_it() -> None:
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 9)
        moves = [Move(f"c{i}", rng.randint(1, 100), rng.randrange(world),
                      tuple(rng.sample(range(world), rng.randint(0, world))))
                 for i in range(rng.randint(0, 30))]
        slots = schedule(moves, rng.randint(50, 300))
        assert by_rank(slots, world) == [own(slots, r) for r in range(world)]
        assert shares(slots, world) == [[s.to_json() for s in own(slots, r)] for r in range(world)]


def reference_batches(moves: Sequence[Move], budget: int) -> list[list[tuple[int, Move]]]:
    """The rule, stated plainly: a move opens a new batch when the current one holds a move and
    one of its receivers would get over ``budget`` bytes in it."""
    out: list[list[tuple[int, Move]]] = []
    load: dict[int, int] = {}
    for i, m in enumerate(moves):
        if out and out[-1] and any(load.get(d, 0) + m.nbytes > budget for d in m.dsts):
            out.append([])
            load = {}
        if not out:
            out.append([])
        out[-1].append((i, m))
        for d in m.dsts:
            load[d] = load.get(d, 0) + m.nbytes
    return out


def test_schedule_batches_as_the_rule_says() -> None:
    rng = random.Random(11)
    for _ in range(500):
        world = rng.randint(1, 6)
        moves = [Move(f"c{i}", rng.randint(1, 100), rng.randrange(world),
                      tuple(rng.sample(range(world), rng.randint(0, world))))
                 for i in range(rng.randint(0, 30))]
        budget = rng.randint(1, 300)
        expected = reference_batches(moves, budget)
        assert batches(moves, budget) == expected
        assert schedule(moves, budget) == [Slot(2 * i, b, m) for b, batch in enumerate(expected) for i, m in batch]
