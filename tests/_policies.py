"""Policies the tests name in a config (``tests._policies:Name``), so that a node agent process loads them too."""

from __future__ import annotations

from tiercache.policy.base import OnFull, Placement, PolicyContext, TierPlan, VersionView

#: The reason :class:`CoalesceRankOne` gives, as ``throughput-adaptive`` words its coalescing.
COALESCED = "coalesced: saves arrive at 2033.3 MB/s, s3 absorbs 15.8 MB/s"


class _Coalescing:
    """Writes every version to every durable tier, except S3 for the versions :meth:`skips` names."""

    def __init__(self, **params: object) -> None:
        pass

    def skips(self, version: VersionView) -> bool:
        raise NotImplementedError

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        skip = self.skips(version)
        return Placement(tuple(TierPlan(n, skip=skip and n == "s3", reason=COALESCED if skip and n == "s3" else "")
                               for n, t in ctx.tiers.items() if t.durable))

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        return []

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        return "wait"


class CoalesceAfterFirst(_Coalescing):
    """Skips S3 for every version but the first step's."""

    def skips(self, version: VersionView) -> bool:
        return version.step > 1


class CoalesceRankOne(_Coalescing):
    """Writes every version everywhere, except rank 1's part of each even step, which it skips for S3.

    The group then skips S3 for that version on every rank (one rank's part is not there): the
    other ranks' parts were written there, and learn of the skip from the group's verdict.
    """

    def skips(self, version: VersionView) -> bool:
        return version.step % 2 == 0 and version.id.endswith(".1")
