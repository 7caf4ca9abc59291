"""How the ranks of a group agree on one outcome: each rank's status, the group's verdict, errors rebuilt.

Every step of a multi-rank save or restore ends with the ranks exchanging a status; each rank
then derives the same verdict from the same list, so a failure on one rank fails the step on
every rank with the same error, type and message (:mod:`tiercache.distributed`,
:mod:`tiercache.peers`, :mod:`tiercache.group_restore`).
"""

from __future__ import annotations

from typing import Any

from tiercache import errors
from tiercache.errors import GroupSaveError, SkippedError, TierCacheError

#: A rank's status for one step: ("ok", payload) | ("skip", message) | ("error", "Type: message").
Status = tuple[str, Any]


def status_of(err: BaseException) -> Status:
    """The status a rank sends for a step that ended with ``err``."""
    if isinstance(err, SkippedError):
        return ("skip", str(err))
    return ("error", f"{type(err).__name__}: {err}")


def verdict(statuses: list[Status], vid: str, what: str) -> BaseException | None:
    """The group's outcome from every rank's status: the first error, else the first skip, else None."""
    failed = [(rank, detail) for rank, (kind, detail) in enumerate(statuses) if kind == "error"]
    if failed:
        return GroupSaveError(f"version {vid} failed on {what}: rank {failed[0][0]}: {failed[0][1]}")
    skipped = [(rank, detail) for rank, (kind, detail) in enumerate(statuses) if kind == "skip"]
    if skipped:
        return SkippedError(f"version {vid} skipped for {what} by rank {skipped[0][0]}: {skipped[0][1]}")
    return None


def broken_group(vid: str, what: str, cause: BaseException) -> GroupSaveError:
    """The error every surviving rank reports when a collective of a step failed (a rank died or timed out).

    It names neither the rank nor the collective that noticed, so every survivor's is the same.
    """
    err = GroupSaveError(f"version {vid} failed on {what}: the process group failed while the ranks agreed on it "
                         "(a rank died or did not answer in time)")
    err.__cause__ = cause
    return err


def rebuild_error(type_name: str, message: str) -> TierCacheError:
    """The tiercache error named ``type_name`` (a :class:`GroupSaveError` if it is not one)."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, TierCacheError):
        return cls(message)
    return GroupSaveError(f"{type_name}: {message}")


__all__ = ["Status", "broken_group", "rebuild_error", "status_of", "verdict"]
