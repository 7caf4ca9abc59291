"""A rank's part of a multi-rank version in the agent: the agent writes the bytes, the ranks agree.

With many ranks the bytes go through the agents and the agreement stays with the ranks
(docs/design.md section 7b). A trainer publishes its part of a group version as any version; the
agent's engine hashes and writes it as the in-process engine would, with a
:class:`TrainerCommitter` as the version's :class:`~tiercache.pipeline.job.Committer`. Whatever
the engine asks of the group (which chunks this rank writes to a tier, how the ranks split the
hashing of replicated chunks, the part being durable on a tier), the committer asks the trainer
over its connection; the trainer's group view answers as it answers its own engine, from the
phases it runs with the other ranks (:mod:`tiercache.group`).

A question is an event ``call`` {``n``, ``v``, ``call``, ``tier``, ``ids``} sent to the trainer
that published the part, and the trainer answers with the request ``answer`` {``n``, ``result``
or ``error``}. If the trainer goes away, every question pending or asked later fails: the
engine then fails the part's levels and its regions go back; nothing in the agent waits for a
trainer that is gone.

What the trainer handed over is kept all the same: a part whose trainer is gone (or whose
group broke) is still hashed whole, by this agent alone if need be (a failed trade of ids only
means hashing the rest here), and its tiers fail only once it is, so the agent can keep it for
a restarted group to adopt (:mod:`tiercache.agent.keep`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from typing import Any

from tiercache.agent.protocol import error_from_wire
from tiercache.errors import AgentUnavailableError
from tiercache.layout import Layout
from tiercache.manifest import Version


class Calls:
    """The questions the agent asked one trainer and waits to hear answered.

    Args:
        send: Sends an event to the trainer (never raises; a trainer gone is noticed by its connection).
    """

    def __init__(self, send: Callable[[Mapping[str, Any]], None]) -> None:
        self._send = send
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._gone: BaseException | None = None

    def ask(self, **fields: Any) -> Future[Any]:
        """Send a question; its future resolves with the trainer's answer (or fails with its error)."""
        f: Future[Any] = Future()
        with self._lock:
            if self._gone is not None:
                f.set_exception(self._gone)
                return f
            n = next(self._ids)
            self._waiting[n] = f
        self._send({"ev": "call", "n": n, **fields})
        return f

    def answer(self, n: int, result: Any = None, error: Mapping[str, Any] | None = None) -> None:
        """The trainer's answer to question ``n`` (one it no longer waits for is ignored)."""
        with self._lock:
            f = self._waiting.pop(n, None)
        if f is None:
            return
        if error is not None:
            f.set_exception(error_from_wire(error))
        else:
            f.set_result(result)

    def close(self, err: BaseException) -> None:
        """The trainer is gone: every question pending or asked from now on fails with ``err``."""
        with self._lock:
            self._gone = err
            waiting, self._waiting = list(self._waiting.values()), {}
        for f in waiting:
            f.set_exception(err)


class TrainerCommitter:
    """The committer of one rank's part in the agent's engine: asks the rank's trainer (see the module docstring).

    Args:
        calls: The questions channel to the trainer that published the part.
        version: The part's id in the agent (the group's version id and the rank).
        rank: The rank whose part this is.
        world: The group's size.
    """

    def __init__(self, calls: Calls, version: str, rank: int, world: int) -> None:
        self._calls = calls
        self._version = version
        self.rank = rank
        self.world = world
        self._hashed: Future[Version] | None = None

    def follow(self, hashed: Future[Version]) -> None:
        """The part's manifest future in the agent's engine (set once the engine has the part)."""
        self._hashed = hashed

    def _ask(self, call: str, **fields: Any) -> Future[Any]:
        return self._calls.ask(v=self._version, call=call, **fields)

    def owned(self, tier: str) -> Collection[str]:
        """See :meth:`tiercache.pipeline.job.Committer.owned`.

        If the group cannot say (the trainer is gone, or its group failed the version), this
        raises only once the part is hashed: a tier that fails the part before its manifest
        exists would settle it before the agent could keep it for a restarted group.
        """
        try:
            return frozenset(str(c) for c in self._ask("owned", tier=tier).result())
        except Exception:
            hashed = self._hashed
            if hashed is not None:
                with contextlib.suppress(Exception):  # a part that cannot be hashed is not kept: no matter why
                    hashed.exception()
            raise

    def commit(self, tier: str, manifest: Version) -> Future[None]:
        """See :meth:`tiercache.pipeline.job.Committer.commit` (the trainer writes the part manifest).

        The answer comes once the group's verdict on ``tier`` is in, so this returns at once.
        """
        return self._ask("commit", tier=tier)

    def split_hashing(self, layout: Layout, paths: list[str]) -> _TrainerSplit | None:
        """See :meth:`tiercache.pipeline.job.Committer.split_hashing` (the trainer has the same layout).

        With the trainer gone (or its group failing the version), the part is hashed whole: a
        restarted group may still adopt it.
        """
        try:
            got = self._ask("split").result()
        except Exception:  # the bytes are here: hashing them all needs nobody
            return None
        if got is None:
            return None
        return _TrainerSplit(self)


class _TrainerSplit:
    """A :class:`~tiercache.pipeline.job.HashSplit` whose trade of ids the trainer makes with the group."""

    def __init__(self, committer: TrainerCommitter) -> None:
        self._committer = committer

    def exchange(self, ids: dict[int, str] | None) -> None:
        """Trade ids through the trainer, for the group to compare.

        With the trainer gone, or the trade failed, the part stays whole all the same: every chunk
        is hashed here, and the group's word on the version reaches the part by its own way.
        """
        wire = None if ids is None else {str(i): c for i, c in ids.items()}
        with contextlib.suppress(Exception):
            self._committer._ask("exchange", ids=wire).result()


class _Gone(AgentUnavailableError):
    """The trainer of a part went away."""


def trainer_left(pid: int) -> AgentUnavailableError:
    """The error the parts of a trainer that went away fail with in the agent."""
    return _Gone(f"the trainer (pid {pid}) went away before its group committed its part")


__all__ = ["Calls", "TrainerCommitter", "trainer_left"]
