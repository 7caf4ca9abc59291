"""The policy contract: what the engine asks, what a policy sees, and what it may answer.

A policy is a plain object the engine consults; it performs no I/O and keeps no reference to the
engine, so it can be unit-tested as a pure function over synthetic :class:`PolicyContext` values.

Call order and threads:

* ``place(version, ctx)`` is called once when a save is submitted (to choose the tiers the version
  goes to and their order) and again by each tier's committer thread right before it writes that
  version (so a backlog seen at that moment can turn into ``skip`` for that tier only).
* ``on_full(needed_bytes, ctx)`` is called on the training thread inside ``save()`` when the RAM
  arena has no room for the new version.
* ``evict(tier, ctx)`` is called by the engine when a tier is over its capacity; the engine
  re-checks every answer and never drops a branch head or a tag, nor a version's last durable
  copy (the keep rule, docs/design.md section 3) unless the policy has a ``retention_rule``: a
  ``str`` naming the retention the user configured (``None`` or absent: none), under which the
  versions it names may be pruned.

All three may be called concurrently from different threads and must not mutate shared state
without their own lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

OnFull = Literal["wait", "evict", "skip"]

#: Round trips of a version's commit after its chunks: the manifest, then the ref.
COMMIT_REQUESTS = 2


@dataclass(frozen=True)
class TierStats:
    """What the policy knows about one tier.

    Attributes:
        name: Tier name (``ram``, ``disk``, ``s3``).
        durable: Whether the tier survives the process.
        capacity: Byte budget or ``None``.
        used_bytes: Bytes held now.
        read_bps: Observed read throughput (EWMA bytes/s), ``None`` before any read.
        write_bps: Observed write throughput (EWMA bytes/s), ``None`` before any write.
        queue_depth: Versions waiting to be written to this tier.
        backlog_bytes: Bytes of those versions.
        remote: Whether a copy there counts as ``remote`` durability (off this machine: S3).
        write_latency_s: Fitted seconds per write request on top of moving its bytes (``None``
            before any write; then ``write_bps`` is the plain observed rate). With it,
            ``write_bps`` is the fitted bandwidth; see :mod:`tiercache.policy.meter`.
        available: Whether the tier answers now (``False`` during an outage, until a probe
            succeeds); a policy should not place versions on an unavailable tier.
        unavailable: Why it is unavailable (the last error), empty while available.
    """

    name: str
    durable: bool
    capacity: int | None
    used_bytes: int
    read_bps: float | None = None
    write_bps: float | None = None
    queue_depth: int = 0
    backlog_bytes: int = 0
    remote: bool = False
    write_latency_s: float | None = None
    available: bool = True
    unavailable: str = ""

    def write_seconds(self, nbytes: int) -> float | None:
        """Predicted seconds to write a version of ``nbytes`` here, its commit included.

        A version is one round of chunk writes plus :data:`COMMIT_REQUESTS` round trips for its
        manifest and ref, each costing the tier's latency; ``None`` while the speed is unknown.
        """
        if self.write_bps is None:
            return None
        return (1 + COMMIT_REQUESTS) * (self.write_latency_s or 0.0) + nbytes / self.write_bps

    def backlog_seconds(self) -> float | None:
        """Predicted seconds until the versions queued here are written (``None`` if unmeasured)."""
        if self.write_bps is None:
            return None
        latency = self.queue_depth * (1 + COMMIT_REQUESTS) * (self.write_latency_s or 0.0)
        return latency + self.backlog_bytes / self.write_bps


@dataclass(frozen=True)
class CodecView:
    """Observed speed and ratio of a codec on recent chunks (``None`` until measured)."""

    name: str
    encode_bps: float | None
    decode_bps: float | None
    ratio: float | None


@dataclass(frozen=True)
class VersionView:
    """A version as the policy sees it.

    Attributes:
        id: Version id (sortable by time).
        branch: Branch name.
        step: Training step.
        nbytes: Tensor bytes.
        created_at: Unix time of the save.
        tiers: Tiers holding every chunk of it.
        pending: Tiers it is still queued for.
        skipped: Tiers it was already skipped for (they will not take it, unless nothing else does).
        pinned: Whether it is a branch head or tagged (never evicted).
        meta: User metadata (for best-N retention).
        float_fraction: Share of its bytes that are floating-point tensors (for codec choice).
    """

    id: str
    branch: str
    step: int
    nbytes: int
    created_at: float
    tiers: frozenset[str] = frozenset()
    pending: frozenset[str] = frozenset()
    pinned: bool = False
    skipped: frozenset[str] = frozenset()
    meta: Mapping[str, Any] = field(default_factory=dict)
    float_fraction: float = 0.0


@dataclass(frozen=True)
class PolicyContext:
    """Everything a policy decision may depend on, captured at one instant.

    Attributes:
        now: Unix time of the snapshot.
        tiers: Per-tier stats, by name, for the configured tiers.
        codecs: Per-codec stats, by descriptor.
        versions: Known versions, oldest first.
        pending: Per tier, ids of versions queued for it, oldest first.
        seconds_since_remote: Seconds since the newest version became remote-durable, or
            ``None`` if none has (or there is no remote tier).
    """

    now: float
    tiers: Mapping[str, TierStats]
    codecs: Mapping[str, CodecView] = field(default_factory=dict)
    versions: Sequence[VersionView] = ()
    pending: Mapping[str, Sequence[str]] = field(default_factory=dict)
    seconds_since_remote: float | None = None


@dataclass(frozen=True)
class TierPlan:
    """The decision for one tier: write with ``codec``, or ``skip`` it for this version."""

    tier: str
    codec: str = "raw/1"
    skip: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Placement:
    """Which durable tiers a version goes to, in order, and how.

    Tiers missing from ``plans`` are skipped. The RAM arena always stages the version first;
    ``keep_in_ram`` says whether it stays there as a read cache once durable.
    """

    plans: tuple[TierPlan, ...]
    keep_in_ram: bool = True

    def plan_for(self, tier: str) -> TierPlan:
        """Return the plan for ``tier`` (a skip if the placement does not name it)."""
        for p in self.plans:
            if p.tier == tier:
                return p
        return TierPlan(tier, skip=True, reason="not placed on this tier")


@runtime_checkable
class Policy(Protocol):
    """Decides placement, eviction and what to do when the RAM arena is full.

    Optional members the engine uses where a policy has them: ``retention_rule`` (see
    :class:`~tiercache.policy.builtin.ThroughputAdaptive`) and ``probe_codecs(version)``: the codecs
    it may choose for the version; those not measured yet are measured on a sample of it before it
    is placed (:mod:`tiercache.pipeline.probe`), so :attr:`PolicyContext.codecs` fill in without a
    version being compressed blind.
    """

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        """Return the tiers ``version`` goes to (in order) with a codec each, or skips."""
        ...

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        """Return version ids to drop from ``tier`` (over capacity), most expendable first."""
        ...

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        """Decide what ``save()`` does when the arena cannot hold ``needed_bytes`` more."""
        ...
