"""Doctor: what the S3 endpoint really enforces, multipart uploads left unfinished, and tiers that are full.

Plain ``doctor`` writes nothing: it reports the conditional-write probe a saving process recorded
before its first ref write, and lists unfinished multipart uploads under the cache's prefix.
``probe=True`` probes now (it writes and deletes a scratch object); ``abort_stale`` aborts
uploads older than that, after checking that the store reports real upload start times (some S3
emulators report a fixed date, which would abort uploads in flight).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tiercache.errors import ConfigError, InvalidArgumentError, StorageError
from tiercache.repo.room import Room, full_tiers
from tiercache.tiers.base import MultipartAdmin

if TYPE_CHECKING:
    from tiercache.repo.repository import Repo

log = logging.getLogger("tiercache.repo.doctor")

#: Largest difference between the store's upload start times and this clock that ages are trusted with.
MAX_CLOCK_SKEW_S = 300.0


@dataclass(frozen=True)
class Upload:
    """An unfinished multipart upload under the cache's prefix.

    Attributes:
        key: The object key it would create.
        upload_id: Its S3 upload id.
        age: Seconds since it was started.
        aborted: Whether doctor aborted it.
    """

    key: str
    upload_id: str
    age: float
    aborted: bool = False


@dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found about the S3 endpoint.

    Attributes:
        probe: The result of ``S3Tier.probe_conditional_writes()`` (``if_none_match``, ``if_match``,
            ``delete_if_match``, ``read_after_write``): run now with ``probe=True``, else the one a
            writer recorded (``{}`` if none did yet).
        probed_at: When that probe ran, or ``None`` if it never did.
        allow_unsafe_refs: Whether the config lets refs be committed on a store without
            conditional writes.
        uploads: Unfinished multipart uploads under the prefix (aborted ones marked).
        full: Durable tiers with no room for the next version, even after eviction, with their
            room (see :mod:`tiercache.repo.room`).
    """

    probe: dict[str, bool]
    probed_at: datetime | None
    allow_unsafe_refs: bool
    uploads: tuple[Upload, ...]
    full: Mapping[str, Room] = field(default_factory=dict)

    @property
    def conditional_writes(self) -> bool:
        """Whether the store enforces both ``If-None-Match: *`` and ``If-Match`` on PUT."""
        return self.probe.get("if_none_match", False) and self.probe.get("if_match", False)

    @property
    def problems(self) -> list[str]:
        """One line per problem, each saying what to do."""
        out = []
        if self.probed_at is None:
            out.append("the S3 endpoint's conditional writes were never probed (a saving process probes them before "
                       "its first ref write): run `tiercache doctor --probe` (it writes and deletes a scratch object)")
        elif not self.conditional_writes:
            out.append(
                "the S3 endpoint ignores conditional writes (If-None-Match/If-Match): two writers could "
                "overwrite each other's refs, so remote ref commits are refused; use a store that enforces "
                "them, or set s3.allow_unsafe_refs = true (or pass --unsafe) if only one writer uses this prefix"
            )
        if self.probed_at is not None and not self.probe.get("read_after_write", False):
            out.append("the S3 endpoint is not read-after-write consistent: a restore may read stale refs")
        for name, r in self.full.items():
            out.append(f"{name} has no room for the next version ({r.free_bytes} bytes free of {r.budget}, "
                       f"{r.reclaimable_bytes} more evictable, the newest version has {r.next_bytes}): new versions "
                       f"skip it; free room on it, raise {name}.capacity or its filesystem, or set a retention")
        stale = [u for u in self.uploads if not u.aborted]
        if stale:
            out.append(f"{len(stale)} unfinished multipart upload(s) under the prefix: run `tiercache doctor "
                       "--abort-stale AGE` to abort those older than AGE seconds")
        return out

    @property
    def refs_ok(self) -> bool:
        """Whether refs can be committed safely (or the unsafe flag accepts the risk)."""
        return (self.conditional_writes or self.allow_unsafe_refs) and self.probe.get("read_after_write", False)

    @property
    def ok(self) -> bool:
        """Whether refs can be committed safely and every durable tier has room for the next version."""
        return self.refs_ok and not self.full

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "ok": self.ok, "conditional_writes": self.conditional_writes, "probe": self.probe,
            "probed_at": self.probed_at.isoformat() if self.probed_at else None,
            "allow_unsafe_refs": self.allow_unsafe_refs, "problems": self.problems,
            "uploads": [u.__dict__ for u in self.uploads],
            "full": {name: {"budget": r.budget, **r.to_json()} for name, r in self.full.items()},
        }


def doctor(repo: Repo, *, abort_stale: float | None = None, unsafe: bool = False, probe: bool = False) -> DoctorReport:
    """Report on the S3 tier (conditional writes, read-after-write, unfinished multipart uploads) and full tiers.

    Args:
        repo: The storage layer (it must have an S3 tier).
        abort_stale: Abort unfinished multipart uploads older than this many seconds.
        unsafe: Accept a store that ignores conditional writes (as ``s3.allow_unsafe_refs``).
        probe: Probe conditional writes now (writes and deletes a scratch object) instead of
            reporting the probe a writer recorded.

    Returns:
        The report.

    Raises:
        ConfigError: If the cache has no S3 tier.
        InvalidArgumentError: If ``abort_stale`` is negative.
        StorageError: If ``abort_stale`` is given and the store's upload start times cannot be
            trusted (more than 5 minutes off this clock); nothing is aborted.
    """
    s3 = repo.durable.get("s3")
    if not isinstance(s3, MultipartAdmin) or repo.config.s3 is None:
        raise ConfigError("doctor checks the S3 tier and this cache has none: add an [s3] table to the config")
    if abort_stale is not None and abort_stale < 0:
        raise InvalidArgumentError(f"--abort-stale must be >= 0 seconds, got {abort_stale}")
    if probe:
        found: dict[str, bool] = dict(s3.probe_conditional_writes())
        probed_at: datetime | None = datetime.now(UTC)
    else:
        recorded = repo.recorded_probe("s3")
        found, probed_at = recorded if recorded is not None else ({}, None)
    if abort_stale is not None:
        skew = s3.upload_clock_skew()
        if abs(skew) > MAX_CLOCK_SKEW_S:
            raise StorageError(
                f"refusing to abort uploads by age: the store reports upload start times {skew:+.0f} s off this "
                "clock (some S3 emulators report a fixed date), so an age would abort uploads in flight; abort "
                "them with the store's own tools"
            )
    now = datetime.now(UTC)
    uploads = []
    for key, upload_id, initiated in s3.list_multipart_uploads():
        age = (now - initiated).total_seconds()
        aborted = abort_stale is not None and age >= abort_stale
        if aborted:
            s3.abort_multipart_upload(key, upload_id)
            log.info("doctor: aborted multipart upload %s of %s (%.0f s old)", upload_id, key, age)
        uploads.append(Upload(key, upload_id, age, aborted))
    return DoctorReport(found, probed_at, repo.config.s3.allow_unsafe_refs or unsafe, tuple(uploads),
                        full_tiers(repo))
