"""The one status type of the group protocol, and the one way to rebuild a remote error.

Every phase of a multi-rank save or restore is an exchange (:mod:`tiercache.group.collective`):
each rank sends a :class:`Status` (``ok`` with a payload, ``skip`` or ``error`` with the error's
type and message), the coordinator derives the group's verdict, also a :class:`Status`, and every
rank gets the same verdict. A failed verdict names the rank and the phase, and
:meth:`Status.error_object` rebuilds it into the same exception, type and message, on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tiercache.errors import GroupSaveError, SkippedError, TierCacheError, error_parts, rebuild_error

Kind = Literal["ok", "skip", "error"]
#: ``json.dumps`` with these separators builds an encoder per call; the coordinator encodes one
#: status per rank per phase.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(frozen=True)
class Status:
    """What one rank says at one phase, or what the group decided.

    Attributes:
        kind: ``ok``, ``skip`` (a policy or the arena left the version out) or ``error``.
        payload: The phase's data (JSON-able) for ``ok``.
        error: For ``error``: the name of the exception's class (a tiercache error, or any other
            class name, which is rebuilt as :class:`~tiercache.errors.GroupSaveError`).
        message: The error's message, or why the version was skipped.
        extra: Small JSON-able facts a failed verdict carries to every rank (``dead``: ranks that
            are gone, ``missing``: ranks that did not answer, ``follows``: this rank fails only
            because another did, see :func:`first_failure`).
    """

    kind: Kind = "ok"
    payload: Any = None
    error: str = ""
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the phase went well."""
        return self.kind == "ok"

    @classmethod
    def of(cls, err: BaseException) -> Status:
        """The status a rank sends for a phase whose local work ended with ``err``."""
        if isinstance(err, SkippedError):
            return cls("skip", message=str(err))
        name, message = error_parts(err)
        return cls("error", error=name, message=message)

    def failed(self, message: str, **extra: Any) -> Status:
        """This failure (``skip`` or ``error``) with ``message`` in place of its own."""
        return Status(self.kind, error=self.error, message=message, extra={**self.extra, **extra})

    def error_object(self, *, wrap: bool = False) -> TierCacheError:
        """The exception this failed status stands for: the same type and message on every rank.

        Args:
            wrap: Make an error of some rank's work a :class:`~tiercache.errors.GroupSaveError`
                (its message names the rank and the original type): a version's level failed
                for the group, and this rank must not take a remote rank's error (a full disk,
                say) for one of its own tiers. Skips and a broken group keep their types.
        """
        if self.kind == "skip":
            return SkippedError(self.message)
        if wrap and self.error != "GroupBrokenError":
            return GroupSaveError(self.message)
        return rebuild_error(self.error, self.message, fallback=GroupSaveError)

    def encode(self) -> bytes:
        """Serialize (JSON: nothing a rank receives is ever unpickled)."""
        return _ENCODE([self.kind, self.payload, self.error, self.message, self.extra]).encode()

    @classmethod
    def decode(cls, data: bytes) -> Status:
        """Parse what :meth:`encode` wrote.

        Raises:
            GroupSaveError: If ``data`` is not a status (a rank of another tiercache version).
        """
        try:
            return cls._of(json.loads(data))
        except (ValueError, TypeError) as e:
            raise GroupSaveError(f"a rank sent a status this tiercache cannot read ({e}): run the same "
                                 "tiercache version on every rank") from None

    @classmethod
    def decode_all(cls, blobs: Sequence[bytes]) -> list[Status]:
        """:meth:`decode` each of ``blobs``, in one JSON parse (the coordinator reads every rank's status).

        Equal blobs whose status holds nothing mutable (no list or dict payload, no extra) give
        one shared object: most ranks send the same ``ok`` at most phases.

        Raises:
            GroupSaveError: If one of them is not a status (the one :meth:`decode` names).
        """
        try:
            rows = json.loads(b"[" + b",".join(blobs) + b"]")
            if len(rows) != len(blobs):
                raise ValueError(len(rows))
            out: list[Status] = []
            shared: dict[bytes, Status] = {}
            for blob, row in zip(blobs, rows, strict=True):
                status = shared.get(blob)
                if status is None:
                    status = cls._of(row)
                    if not status.extra and not isinstance(status.payload, list | dict):
                        shared[blob] = status
                out.append(status)
            return out
        except (ValueError, TypeError):
            return [cls.decode(b) for b in blobs]  # one by one: the bad one raises, named as decode names it

    @classmethod
    def _of(cls, row: Any) -> Status:
        kind, payload, error, message, extra = row
        if kind not in ("ok", "skip", "error"):
            raise ValueError(kind)
        return cls(kind, payload, str(error), str(message), dict(extra))


OK = Status()


def first_failure(statuses: list[Status | None]) -> tuple[int, Status] | None:
    """The first error in rank order, else the first skip, else ``None`` (missing answers are not failures).

    A failure marked ``follows`` (a rank that fails only because another did) is the cause only
    if no other rank failed.
    """
    for follows in (False, True):
        for kind in ("error", "skip"):
            for rank, s in enumerate(statuses):
                if s is not None and s.kind == kind and bool(s.extra.get("follows")) == follows:
                    return rank, s
    return None


__all__ = ["OK", "Kind", "Status", "first_failure"]
