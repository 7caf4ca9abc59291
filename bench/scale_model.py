"""``python -m bench.scale_model``: checkpoint times on 8 to 4096 nodes, extrapolated from per-node figures.

A model, not a measurement: it combines the bandwidths of one node (NVMe, network, S3) with the
ratios tiercache reached against the raw limits in ``docs/benchmarks.md``, and with how the
multi-rank protocol spreads the bytes (``tiercache.group``), to tell how long each
durability level takes and how long a restore after one lost node takes, for a job of ``N`` nodes.
``docs/scale.md`` shows its table and how to size ``[peers] copies`` and the checkpoint interval.

Assumptions (all stated as parameters of :class:`Inputs`):

- the state is ``state_bytes`` in total (parameters, optimizer state), sharded over the nodes and
  replicated ``replicas`` times (HSDP; ``replicas = 1``: FSDP across all nodes; ``replicas =
  nodes``: DDP, every node holds everything): a node's part is ``state * replicas / nodes``;
- ``staged`` costs one memcpy of the node's part per GPU's share, in parallel on the node's GPUs;
- ``local``: every node writes its part to its own NVMe at the measured fraction of the raw write
  bandwidth, all nodes in parallel;
- ``replicated``: then each node sends ``copies`` copies of its part over its network link and
  receives as many (full duplex), at the assumed fraction of the link (gloo over TCP); nodes that
  already hold a part (DDP) receive nothing;
- ``remote``: the distinct bytes (one copy of the state) go to S3 once, split over all nodes, at
  the smaller of the store's aggregate bandwidth and the nodes' own, at the measured ratio to a
  boto3 multipart upload; chunks spread over 256 key prefixes (``chunks/<id[:2]>/``), so the
  requests per prefix are the aggregate request rate over 256;
- restore after one lost node: every surviving node reads its part from its own NVMe while the
  replacement node receives its part from its peers (``copies >= 1``) or reads it from S3 alone
  (``copies = 0``); the restore takes the slower of the two;
- metadata (the control plane, measured by ``bench/control_plane.py`` on this repository's
  2-core VM, see ``docs/benchmarks.md``, "Control plane"): each level also waits for its
  exchanges, whose coordinator work is ``fixed + per_rank x ranks`` (fitted on 8 to 4096 ranks,
  FSDP layout: every rank's chunks its own), plus the polling latency of each exchange, plus each
  rank's own part manifest (``leaves_per_rank`` tensors: built and serialized at save, read and
  parsed at restore, every rank in parallel). ``staged`` (the save wait) includes the ``begin``
  exchange ``save()`` takes part in. The metadata is added to the data time, not overlapped with
  it (an upper bound);
- failures: one node fails every ``node_mtbf_h`` hours (Llama 3: 419 interruptions in 54 days on
  16,384 GPUs, i.e. about one per 6,300 hours of a 8-GPU node), so the job fails every
  ``node_mtbf_h / nodes`` hours; the interval is Young's ``sqrt(2 * wait * MTBF)`` with the save
  wait as the cost, never shorter than the time to the level that survives a node loss
  (``replicated`` with ``copies >= 1``, else ``remote``), so that level keeps up with the saves.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

GB = 1e9
#: Ratios measured in docs/benchmarks.md (tiercache time / limit time).
LOCAL_VS_RAW_WRITE = 1.35
REMOTE_VS_BOTO3 = 0.89
RESTORE_VS_RAW_READ = 1.34
#: The coordinator's work per version to each level (seconds = fixed + per rank x ranks), the
#: medians of ``python -m bench.control_plane`` (FSDP layout) fitted by least squares over 8 to 4096 ranks.
#: Each level counts from the call to ``save()``: ``begin`` is the exchange inside ``save()``;
#: ``local`` adds ``parts``, ``disk`` and the nodes' commits; ``replicated`` the peer copies' two;
#: ``remote`` is ``begin``, ``parts`` and ``s3`` (with the commit); ``restore`` the five exchanges of a
#: restore at the same world size. ``python -m bench.control_plane`` prints these from its run.
CONTROL_S: dict[str, tuple[float, float]] = {
    "begin": (0.0006, 9.4e-6),
    "local": (0.0094, 57.9e-6),
    "replicated": (0.0592, 204.2e-6),
    "remote": (0.0078, 56.0e-6),
    "restore": (0.0031, 28.7e-6),
}
#: Exchanges on each level's path, counted from ``save()`` (``begin`` is in ``staged`` and in each
#: level), and the median wall-clock latency one adds beyond the coordinator's work at 512 and
#: 4096 ranks (both sides polling; it can reach ``0.05 s x ranks / 256`` when ranks wait longer).
EXCHANGES = {"begin": 1, "local": 4, "replicated": 6, "remote": 3, "restore": 5}
PHASE_LATENCY_S = 0.17
#: One rank's own part manifest, per tensor: built and serialized for a save; read and parsed for
#: a restore (measured on 20,000 leaves).
PART_SAVE_S_PER_LEAF = 25.7e-6
PART_RESTORE_S_PER_LEAF = 28.2e-6
#: S3's documented rate per prefix before it partitions further, and tiercache's chunk prefixes.
S3_PUTS_PER_PREFIX = 3500
PREFIXES = 256


@dataclass(frozen=True)
class Inputs:
    """One job and its hardware; every field is an assumption the table states.

    Attributes:
        state_bytes: The whole training state.
        replicas: Data-parallel replicas of the sharded state (1: FSDP; ``nodes``: DDP).
        gpus_per_node: GPUs (ranks) per node.
        memcpy_gbps: Device-to-host copy per GPU (GB/s), for the save wait.
        nvme_write_gbps: Raw NVMe write of one node (GB/s).
        nvme_read_gbps: Raw NVMe read of one node (GB/s).
        net_gbps: One node's network link for peer copies (GB/s, each direction).
        peer_efficiency: Fraction of the link the peer copies reach (gloo over TCP).
        s3_node_gbps: What one node can send to or read from S3 (GB/s).
        s3_total_gbps: What the store serves to the whole job (GB/s).
        part_bytes: Size of one S3 request (multipart part or chunk).
        copies: ``[peers] copies``.
        node_mtbf_h: Hours between failures of one node.
        leaves_per_rank: Tensors in each rank's part (its part manifest's size; FSDP shards every
            tensor, so it does not shrink with more nodes).
    """

    state_bytes: float = 2e12
    replicas: int = 1
    gpus_per_node: int = 8
    memcpy_gbps: float = 25.0
    nvme_write_gbps: float = 6.0
    nvme_read_gbps: float = 12.0
    net_gbps: float = 25.0
    peer_efficiency: float = 0.5
    s3_node_gbps: float = 3.0
    s3_total_gbps: float = 200.0
    part_bytes: float = 16 * 2**20
    copies: int = 1
    node_mtbf_h: float = 6300.0
    leaves_per_rank: int = 20_000


@dataclass(frozen=True)
class Row:
    """The model's answer for one number of nodes (seconds unless named otherwise)."""

    nodes: int
    part_gb: float
    staged: float
    local: float
    replicated: float
    remote: float
    puts_per_prefix: float
    restore_peers: float
    restore_s3: float
    restore_all_s3: float
    job_mtbf_h: float
    interval: float
    meta_local: float = 0.0


def control(level: str, ranks: int, i: Inputs) -> float:
    """The metadata's share of the time to ``level`` (or of ``begin``, or ``restore``) at ``ranks`` ranks."""
    fixed, per_rank = CONTROL_S[level]
    own = 0.0
    if level in ("local", "replicated", "remote"):
        own = i.leaves_per_rank * PART_SAVE_S_PER_LEAF
    elif level == "restore":
        own = i.leaves_per_rank * PART_RESTORE_S_PER_LEAF
    return fixed + per_rank * ranks + EXCHANGES[level] * PHASE_LATENCY_S + own


def model(nodes: int, i: Inputs) -> Row:
    """Times to each level and restore times for ``nodes`` nodes, metadata included."""
    replicas = min(i.replicas, nodes)
    ranks = nodes * i.gpus_per_node
    part = i.state_bytes * replicas / nodes
    staged = part / i.gpus_per_node / (i.memcpy_gbps * GB) + control("begin", ranks, i)
    meta_local = control("local", ranks, i)
    local = part / (i.nvme_write_gbps * GB) * LOCAL_VS_RAW_WRITE + meta_local
    send = 0.0 if replicas >= nodes else part * i.copies
    replicated = local - meta_local + send / (i.net_gbps * GB * i.peer_efficiency) + control("replicated", ranks, i)
    s3_rate = min(i.s3_total_gbps, nodes * i.s3_node_gbps) * GB
    remote = max(staged, i.state_bytes / s3_rate * REMOTE_VS_BOTO3) + control("remote", ranks, i)
    puts = s3_rate / i.part_bytes / PREFIXES
    meta_restore = control("restore", ranks, i)
    survivors = part / (i.nvme_read_gbps * GB) * RESTORE_VS_RAW_READ + meta_restore
    from_peers = part / (i.net_gbps * GB * i.peer_efficiency) + meta_restore
    from_s3 = part / (min(i.s3_node_gbps, i.s3_total_gbps) * GB) + meta_restore
    all_s3 = i.state_bytes / s3_rate + part / (i.net_gbps * GB * i.peer_efficiency) + meta_restore
    job_mtbf = i.node_mtbf_h / nodes
    # A node loss is survived by `replicated` (copies >= 1), else only by `remote`.
    interval = max(math.sqrt(2 * staged * job_mtbf * 3600), replicated if i.copies else remote)
    return Row(nodes, part / GB, staged, local, replicated if i.copies else math.nan, remote, puts,
               max(survivors, from_peers) if i.copies else math.nan, max(survivors, from_s3), all_s3, job_mtbf,
               interval, meta_local)


def table(i: Inputs, counts: list[int]) -> str:
    """The model's rows as a fixed-width text table."""
    head = (f"{'nodes':>5} {'ranks':>6} {'part GB':>7} {'staged':>7} {'local':>7} {'(meta)':>7} {'replic.':>7} "
            f"{'remote':>7} {'PUT/s/prefix':>12} {'restore':>8} {'no peers':>8} {'all S3':>7} {'job MTBF':>8} "
            f"{'interval':>8}")
    lines = [head]
    for n in counts:
        r = model(n, i)
        lines.append(
            f"{r.nodes:>5} {n * i.gpus_per_node:>6} {r.part_gb:>7.1f} {_s(r.staged, 2):>7} {_s(r.local):>7} "
            f"{_s(r.meta_local):>7} {_s(r.replicated):>7} {_s(r.remote, 0):>7} {r.puts_per_prefix:>12.0f} "
            f"{_s(r.restore_peers):>8} {_s(r.restore_s3):>8} {_s(r.restore_all_s3):>7} {r.job_mtbf_h:>7.1f}h "
            f"{_duration(r.interval):>8}"
        )
    return "\n".join(lines)


def _s(seconds: float, digits: int = 1) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.{digits}f}s"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f}min" if seconds >= 60 else f"{seconds:.0f}s"


def main() -> None:
    """Print the table for the given hardware (defaults: see :class:`Inputs`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Inputs()
    for name in ("state_bytes", "replicas", "gpus_per_node", "memcpy_gbps", "nvme_write_gbps", "nvme_read_gbps",
                 "net_gbps", "peer_efficiency", "s3_node_gbps", "s3_total_gbps", "copies", "node_mtbf_h",
                 "leaves_per_rank"):
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--nodes", default="8,32,128,512,1024,2048,4096")
    args = parser.parse_args()
    inputs = replace(defaults, **{k: v for k, v in vars(args).items() if k != "nodes"})
    print(table(inputs, [int(n) for n in args.nodes.split(",")]))


if __name__ == "__main__":
    main()
