"""The handle ``save()`` returns: the version id and one future per durability level."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

from tiercache.errors import InvalidArgumentError

Level = Literal["staged", "local", "replicated", "remote", "durable"]
LEVELS: tuple[str, ...] = ("staged", "local", "replicated", "remote", "durable")
#: The durability level each durable tier provides.
TIER_LEVEL = {"disk": "local", "s3": "remote"}
#: Levels that only a multi-rank save with peer copies provides (no tier of one process does).
GROUP_LEVELS: tuple[str, ...] = ("replicated",)


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
