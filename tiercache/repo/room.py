"""Whether a durable tier has room for the next version: what ``stats``, the ui and ``doctor`` call *full*.

A tier's room is its budget (its ``capacity``, or what its filesystem has room for, see
:meth:`~tiercache.tiers.base.Tier.budget`) less what it holds, plus what capacity eviction could
give back there under the keep rule (docs/design.md section 3): copies another durable tier
holds whole, never a branch head or tag, nor the newest version of a branch on that tier. The
next version is taken to be as large as the newest one known (its chunks shared with versions
already there would need less). A tier whose room is smaller is *full*: new versions skip it
until room is made (or go nowhere else, and fail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.errors import TierCacheError

if TYPE_CHECKING:
    from tiercache.repo.repository import Repo


@dataclass(frozen=True)
class Room:
    """The room a durable tier has for the next version.

    Attributes:
        budget: The most bytes the tier may hold now (``None``: nothing bounds it).
        free_bytes: The budget less what the tier holds.
        reclaimable_bytes: What capacity eviction may give back there (see the module docstring).
        next_bytes: The size of the newest version known: what the next one is taken to need.
    """

    budget: int | None
    free_bytes: int | None
    reclaimable_bytes: int
    next_bytes: int

    @property
    def full(self) -> bool:
        """Whether the next version does not fit, even after eviction (never for an unbounded tier)."""
        if self.free_bytes is None:
            return False
        return self.free_bytes + self.reclaimable_bytes < max(self.next_bytes, 1)

    def to_json(self) -> dict[str, Any]:
        """The fields ``stats`` adds to a tier's entry."""
        return {"full": self.full, "free_bytes": self.free_bytes, "reclaimable_bytes": self.reclaimable_bytes,
                "next_version_bytes": self.next_bytes}


def room(repo: Repo, tier: str) -> Room:
    """The room durable tier ``tier`` has for the next version (see the module docstring).

    Raises:
        StorageError: If the tier cannot tell what it holds (it is down).
    """
    t = repo.durable[tier]
    budget = t.budget()
    if budget is None:
        return Room(None, None, 0, 0)
    free = max(budget - t.used_bytes(), 0)
    cat = repo.catalog
    versions = sorted(cat.all(), key=lambda v: v.id)
    on = [v for v in versions if cat.manifest_on(tier, v.id)]
    others = [n for n in repo.durable if n != tier]
    pinned = {r.version for r in cat.refs().values()}
    newest = {v.branch: v.id for v in on}  # oldest first: the last of each branch stays
    doomed = [v for v in on if v.id not in pinned and newest[v.branch] != v.id
              and any(cat.manifest_on(n, v.id) for n in others)]
    gone = {v.id for v in doomed}
    kept = {c.id for v in on if v.id not in gone for c in v.chunks}
    sizes = {c.id: c.nbytes for v in doomed for c in v.chunks if c.id not in kept}
    return Room(budget, free, sum(sizes.values()), versions[-1].nbytes if versions else 0)


def full_tiers(repo: Repo) -> dict[str, Room]:
    """The durable tiers that answer and are full now, with their room (see :func:`room`)."""
    out = {}
    for name in repo.durable:
        if not repo.available(name):
            continue
        try:
            r = room(repo, name)
        except TierCacheError:
            continue  # it failed just now: marked down on its next write, and reported as such
        if r.full:
            out[name] = r
    return out
