"""The handle ``save()`` returns: the version id and one future per durability level."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Literal, get_args

from tiercache.errors import InvalidArgumentError

log = logging.getLogger("tiercache.handle")

Level = Literal["staged", "local", "replicated", "remote", "durable"]
#: Every durability level a handle may have, in the order they are shown; "replicated" exists
#: only where the cache has peer copies.
LEVELS: tuple[Level, ...] = get_args(Level)
#: The durability level each durable tier provides.
TIER_LEVEL = {"disk": "local", "s3": "remote"}
#: Levels that only a multi-rank save with peer copies provides (no tier of one process does).
GROUP_LEVELS: tuple[str, ...] = ("replicated",)

#: Levels settled a second time with another outcome (a pipeline bug), newest last; the test
#: suite checks after every test that none was (see :func:`settled_twice`).
_SETTLED_TWICE: deque[str] = deque(maxlen=64)


def settled_twice() -> list[str]:
    """Every level settled twice since the process started (or :func:`forget_settled_twice`), as messages.

    A level is settled once: a second outcome means two parts of the pipeline each thought
    they decided it (the second raised :class:`~concurrent.futures.InvalidStateError` on the
    thread that tried, which may have turned it into a log line). Tests assert this is empty.
    """
    return list(_SETTLED_TWICE)


def forget_settled_twice() -> None:
    """Clear the record :func:`settled_twice` returns (a test that provokes one on purpose)."""
    _SETTLED_TWICE.clear()


class LevelFuture(Future[str]):
    """The future of one durability level of one version: its outcome is decided once.

    :meth:`set_result` and :meth:`set_exception` raise :class:`InvalidStateError` on a level
    already settled, as any future does, and also log it as an error and record it for
    :func:`settled_twice`, so a second decision is loud even where the raise is caught.
    :meth:`fail_unless_settled` and :meth:`reach` are for the two places where several parts
    may settle a level and the first decides: a failure that fails whatever is still pending,
    and ``durable``, reached by whichever tier commits first.

    Args:
        version: The version id (its result once reached).
        level: The level's name.
    """

    def __init__(self, version: str, level: str) -> None:
        super().__init__()
        self.version = version
        self.level = level

    def set_result(self, result: str) -> None:
        """Settle the level as reached; raise (and record) if it is settled already."""
        try:
            super().set_result(result)
        except InvalidStateError:
            self._twice(f"reached ({result})")
            raise

    def set_exception(self, exception: BaseException | None) -> None:
        """Settle the level as failed; raise (and record) if it is settled already."""
        try:
            super().set_exception(exception)
        except InvalidStateError:
            self._twice(f"failed ({type(exception).__name__}: {exception})")
            raise

    def cancel(self) -> bool:
        """Refuse: a level cannot be cancelled (the write goes on whatever a caller waits for)."""
        return False

    def fail_unless_settled(self, exception: BaseException) -> bool:
        """Fail the level if it is still pending; return whether this call failed it.

        A level that failed already keeps its first error. One that was *reached* is recorded as
        settled twice (a failure after a reported success contradicts it) and left reached.
        """
        try:
            super().set_exception(exception)
        except InvalidStateError:
            if self.exception() is None:
                self._twice(f"failed ({type(exception).__name__}: {exception})")
            return False
        return True

    def reach(self) -> bool:
        """Mark the level reached unless it was already (the first tier to commit decides ``durable``).

        A level that *failed* already is recorded as settled twice and left failed.
        """
        try:
            super().set_result(self.version)
        except InvalidStateError:
            if self.exception() is not None:
                self._twice("reached")
            return False
        return True

    def _twice(self, then: str) -> None:
        err = self.exception()
        was = f"reached ({self.result()})" if err is None else f"failed ({type(err).__name__}: {err})"
        msg = f"level {self.level!r} of version {self.version} settled twice: {was}, then {then}"
        _SETTLED_TWICE.append(msg)
        log.error("%s", msg)


def level_futures(version: str) -> dict[str, Future[str]]:
    """One pending :class:`LevelFuture` per level of ``version``, by level."""
    return {lvl: LevelFuture(version, lvl) for lvl in LEVELS}


class SaveHandle:
    """The result of ``save()``: the version id and one future per durability level.

    Levels: ``staged`` (in the RAM arena; lost with the process), ``local`` (chunks, manifest and
    ref durable on the disk tier; for a multi-rank version, on every node's disk), ``replicated``
    (a multi-rank version with peer copies: every node's part also on ``peers.copies`` other
    nodes), ``remote`` (durable in S3 with the ref committed), and ``durable`` (whichever of
    ``local`` and ``remote`` is reached first). A level the cache has no tier for (``replicated``
    for a single-process save), or that the policy skipped for this version, fails with a clear
    error instead of hanging.
    """

    def __init__(self, version: str, futures: dict[str, Future[str]]) -> None:
        self.version = version
        self._futures = futures

    def future(self, level: Level = "durable") -> Future[str]:
        """The future of one level; its result is the version id."""
        if level not in self._futures:
            raise InvalidArgumentError(f"unknown durability level {level!r}: use one of {', '.join(LEVELS)}")
        return self._futures[level]

    def wait(self, level: Level = "durable", timeout: float | None = None) -> str:
        """Block until ``level`` is reached; re-raise the error of the write if it failed.

        Returns:
            The version id.
        """
        return self.future(level).result(timeout)

    def done(self, level: Level = "durable") -> bool:
        """Whether ``level`` is settled, successfully or not (as ``Future.done()``); see :meth:`succeeded`."""
        return self.future(level).done()

    def succeeded(self, level: Level = "durable") -> bool:
        """Whether ``level`` has been reached (``False`` while pending or if it failed or was skipped)."""
        f = self.future(level)
        return f.done() and not f.cancelled() and f.exception() is None

    def __repr__(self) -> str:
        states = {k: ("ok" if self.succeeded(k) else "failed" if f.done() else "pending")
                  for k, f in self._futures.items()}
        return f"SaveHandle({self.version}, {states})"
