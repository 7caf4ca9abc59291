"""The status a saving process publishes for viewers in other processes (``tiercache ui``, ``plan``).

A CLI or UI process sees what the durable tiers hold (versions, refs, residency) but not another
process's RAM arena, queues or timings. The process that saves keeps them in a
:class:`StatusRecorder`, fed by ``TierCache.save`` (the save wait) and by done-callbacks on each
save's durability futures (when each level was reached, or why not), and writes them as one JSON
object to :data:`STATUS_KEY` on its first durable tier: at most once per ``ui.status_interval``
seconds (the first time one interval after the recorder is made), from a thread of its own, and
once more when the cache closes. The write replaces the
object atomically (the tier's ``put``), so a reader sees the old or the new status, never a mix.

A cache that only reads (``tiercache ls``, ``tiercache ui``) never makes a recorder, so it writes
nothing. Everything in the object is bounded: the newest :data:`RECENT_VERSIONS` versions, the
newest :data:`RECENT_ERRORS` errors, :data:`LAG_HISTORY` lag samples and :data:`RECENT_SAMPLES`
samples per measurement.

The object (``schema_version`` 1; typed by :class:`tiercache.runtime.Status`), times in Unix seconds::

    {"schema_version": 1, "pid": 1234, "writer": "trainer" | "agent", "started_at": t, "updated_at": t,
     "closed": false,
     "levels": ["staged", "local", "remote", "durable"],
     "staged": {"version", "branch", "step", "at"} | null,       # the newest save() call
     "training": {branch: {"step", "at"}},                         # newest step seen (saves, advisor)
     "newest": {branch: {level: {"version", "step", "created_at", "reached_at"}}},
     "lag": {branch: {level: {"steps", "seconds"} | null}},        # behind "training"
     "lag_history": [{"t", "branch", "step", "levels": {level: {"steps", "seconds"} | null}}],
     "save_wait": samples, "time_to": {level: samples},            # samples: see Samples.to_json
     "restore": samples, "restart": samples,                       # restores of the newest version, restarts
     "queues": {level: versions of this process not yet at that level},
     "versions": {id: {"branch", "step", "created_at", "wait_s",
                       "levels": {level: {"state", "at", "reason"}}}},
     "errors": [{"t", "version", "branch", "step", "level", "error", "message"}],
     "meter": ThroughputMeter.snapshot(), "advice": Plan.to_json() | null}

``pid`` is the writer's: the training process itself, or (``writer`` ``"agent"``) the node agent
that saves for the trainers of the node, which outlives them. ``training`` is the newest step of
a version that did not fail (a version whose ``durable`` level failed is no step a restart can
resume from) or that the advisor reported. ``error`` names the error's public class (the first
in its MRO whose name does not start with ``_``).

``restore`` is how long each restore that a trainer reported took (with a node agent, every
trainer of the node reports its restores to the agent); ``restart`` how long each restart took,
from the moment the last trainer that saved through the agent left it until a new trainer began
its restore (only a node agent, which outlives its trainers, can see that).

``state`` is ``pending``, ``held`` (reached), ``skipped`` (the policy or the arena skipped it;
the reason says why) or ``failed`` (the reason is the error). Lag at a level is the training
step and time minus the step and save time of the newest version of the branch that reached it:
what a failure now would lose if the job restarted from that level.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from pydantic import ValidationError

from tiercache.errors import ConfigError, InvalidArgumentError, SkippedError, TierCacheError
from tiercache.handle import LEVELS, SaveHandle
from tiercache.runtime import LAG_HISTORY, RECENT_ERRORS, RECENT_SAMPLES, RECENT_VERSIONS, Lag, LagSample, Status

log = logging.getLogger("tiercache.status")

#: Where the saving process leaves its status (on its first durable tier).
STATUS_KEY = "stats/status.json"
STATUS_SCHEMA = 1
#: Weight of the newest sample in a measurement's EWMA (recent saves matter most, one outlier less).
EWMA_WEIGHT = 0.3


class Samples:
    """One measurement (seconds): an EWMA of every sample and the newest few as they were."""

    __slots__ = ("count", "ewma", "last", "recent")

    def __init__(self) -> None:
        self.count = 0
        self.ewma: float | None = None
        self.last: float | None = None
        self.recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)

    def add(self, at: float, value: float) -> None:
        """Record ``value`` (seconds) observed at Unix time ``at``."""
        value = max(0.0, float(value))
        self.ewma = value if self.ewma is None else (1 - EWMA_WEIGHT) * self.ewma + EWMA_WEIGHT * value
        self.last = value
        self.count += 1
        self.recent.append((at, value))

    def to_json(self) -> dict[str, Any]:
        """``{"ewma", "last", "count", "recent": [[t, seconds], ...]}`` (oldest sample first)."""
        return {"ewma": self.ewma, "last": self.last, "count": self.count, "recent": [list(s) for s in self.recent]}


def _lag(training: Mapping[str, float] | None, newest: Mapping[str, Any] | None) -> dict[str, float] | None:
    if training is None or newest is None:
        return None
    return {"steps": training["step"] - newest["step"], "seconds": max(0.0, training["at"] - newest["created_at"])}


class StatusRecorder:
    """What this process's saves are doing, published for other processes (see the module docstring).

    Every method may be called from any thread; durability callbacks arrive on the engine's
    threads and only take a short lock. A thread of the recorder's own writes the object.

    Args:
        write: Stores the encoded object (``Repo.put_record`` at :data:`STATUS_KEY`),
            or ``None`` to keep the status in memory only (a cache with no durable tier).
        interval: Fewest seconds between two writes.
        meter: Returns the throughput meter's snapshot (its history included).
        clock: Unix time, for timestamps and durations (tests pass a fake one).
        writer: Who publishes: ``"trainer"`` (the saving process) or ``"agent"`` (a node agent).
    """

    def __init__(
        self,
        write: Callable[[bytes], object] | None,
        *,
        interval: float,
        meter: Callable[[], dict[str, Any]],
        clock: Callable[[], float] = time.time,
        writer: str = "trainer",
    ) -> None:
        self._write_fn = write
        self._writer = writer
        self._interval = interval
        self._meter = meter
        self._clock = clock
        self._cv = threading.Condition()
        self._started_at = clock()
        self._levels: list[str] = []
        self._staged: dict[str, Any] | None = None
        self._branch = "main"
        self._training: dict[str, dict[str, float]] = {}
        #: Newest step the advisor reported per branch (no version of its own: it never fails).
        self._advised: dict[str, dict[str, float]] = {}
        self._failed: set[str] = set()
        self._newest: dict[str, dict[str, dict[str, Any]]] = {}
        # Typed as they are taken: a write then dumps them without validating hundreds of dicts again.
        self._lag_history: deque[LagSample] = deque(maxlen=LAG_HISTORY)
        self._save_wait = Samples()
        self._time_to: dict[str, Samples] = {}
        self._restore = Samples()
        self._restart = Samples()
        self._pending: dict[str, set[str]] = {}
        self._versions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self._advice: dict[str, Any] | None = None
        self._dirty = False
        self._closed = False
        self._write_failed = False
        # The first write too waits an interval: the first events come with the first save, when
        # the disk is busiest writing it.
        self._last_write = time.monotonic()
        self._thread: threading.Thread | None = None
        if write is not None:
            self._thread = threading.Thread(target=self._run, name="tiercache-status", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ what the trainer tells

    def note_save(self, handle: SaveHandle, *, step: int, branch: str, started_at: float, wait_s: float) -> None:
        """Record a ``save()`` that returned after ``wait_s`` seconds, and follow its levels.

        Args:
            handle: The save's handle; a done-callback on each of its futures records the level.
            step: The step saved.
            branch: The branch saved on.
            started_at: Unix time ``save()`` was called (the version's training time).
            wait_s: Seconds the caller was blocked in ``save()``.
        """
        futures: dict[str, Future[str]] = {}
        for level in LEVELS:
            try:
                futures[level] = handle.future(level)
            except InvalidArgumentError:
                continue  # a level this cache's handles do not have
        vid = handle.version
        with self._cv:
            self._branch = branch
            self._staged = {"version": vid, "branch": branch, "step": step, "at": started_at}
            self._see_step(branch, step, started_at)
            self._save_wait.add(started_at + wait_s, wait_s)
            self._versions[vid] = {"branch": branch, "step": step, "created_at": started_at, "wait_s": wait_s,
                                   "levels": {lvl: {"state": "pending", "at": None, "reason": ""} for lvl in futures}}
            while len(self._versions) > RECENT_VERSIONS:
                self._failed.discard(self._versions.popitem(last=False)[0])
            for lvl in futures:
                self._pending.setdefault(lvl, set()).add(vid)
            self._touch(branch)
        for lvl, fut in futures.items():
            # Outside the lock: a future already done runs its callback right here.
            fut.add_done_callback(functools.partial(self._settled, vid, branch, step, started_at, lvl))

    def note_step(self, step: int, advice: Mapping[str, Any] | None = None) -> None:
        """Record that training reached ``step`` (on the branch of the newest save), and the current advice."""
        with self._cv:
            now = self._clock()
            self._see_step(self._branch, step, now)
            cur = self._advised.get(self._branch)
            if cur is None or step >= cur["step"]:
                self._advised[self._branch] = {"step": step, "at": now}
            if advice is not None:
                self._advice = dict(advice)
            self._touch(self._branch)

    def note_restore(self, seconds: float, *, at: float) -> None:
        """Record a restore that took ``seconds`` and ended at Unix time ``at``."""
        with self._cv:
            self._restore.add(at, seconds)
            self._dirty = True
            self._cv.notify_all()

    def note_restart(self, seconds: float, *, at: float) -> None:
        """Record a restart: ``seconds`` from the failure until the new trainer began its restore, at ``at``."""
        with self._cv:
            self._restart.add(at, seconds)
            self._dirty = True
            self._cv.notify_all()

    def _see_step(self, branch: str, step: int, at: float) -> None:
        cur = self._training.get(branch)
        if cur is None or step >= cur["step"]:
            self._training[branch] = {"step": step, "at": at}

    def _retract(self, vid: str, branch: str) -> None:
        """Training of ``branch`` without ``vid``, a version that failed (call with the lock held)."""
        self._failed.add(vid)
        seen = [{"step": v["step"], "at": v["created_at"]} for k, v in self._versions.items()
                if v["branch"] == branch and k not in self._failed]
        if branch in self._advised:
            seen.append(self._advised[branch])
        if seen:
            self._training[branch] = dict(max(seen, key=lambda t: (t["step"], t["at"])))
        else:
            self._training.pop(branch, None)

    def _settled(self, vid: str, branch: str, step: int, started_at: float, level: str, fut: Future[str]) -> None:
        now = self._clock()
        cancelled = fut.cancelled()
        err = None if cancelled else fut.exception()
        with self._cv:
            self._pending.get(level, set()).discard(vid)
            levels = self._versions.get(vid, {}).get("levels", {})
            if isinstance(err, ConfigError):
                # The cache has no tier for this level: not a level of this cache at all.
                levels.pop(level, None)
                if not self._pending.get(level):
                    self._pending.pop(level, None)
                return
            if level not in self._levels:
                self._levels.append(level)
                self._levels.sort(key=LEVELS.index)
            if err is None and not cancelled:
                self._time_to.setdefault(level, Samples()).add(now, now - started_at)
                cur = self._newest.setdefault(branch, {}).get(level)
                if cur is None or vid > cur["version"]:
                    self._newest[branch][level] = {"version": vid, "step": step, "created_at": started_at,
                                                   "reached_at": now}
                state, reason = "held", ""
            elif isinstance(err, SkippedError):
                state, reason = "skipped", str(err)
            else:
                state = "failed"
                name = public_name(err) if err is not None else "CancelledError"
                reason = f"{name}: {err}" if err is not None else "cancelled"
                self._errors.append({"t": now, "version": vid, "branch": branch, "step": step, "level": level,
                                     "error": name, "message": str(err) if err is not None else "cancelled"})
                if level == "durable" and vid in self._versions:
                    self._retract(vid, branch)
            if level in levels:
                levels[level] = {"state": state, "at": now, "reason": reason}
            self._touch(branch)

    def _touch(self, branch: str) -> None:
        """Take a lag sample of ``branch`` and wake the writer (call with the lock held)."""
        self._lag_history.append(LagSample(t=self._clock(), branch=branch,
                                           step=self._training.get(branch, {}).get("step"),
                                           levels=self._lag_of(branch)))
        self._dirty = True
        self._cv.notify_all()

    def _lag_of(self, branch: str) -> dict[str, dict[str, float] | None]:
        newest = self._newest.get(branch, {})
        return {lvl: _lag(self._training.get(branch), newest.get(lvl)) for lvl in self._levels}

    # ------------------------------------------------------------------ what viewers read

    def costs(self) -> dict[str, Any]:
        """The measurements alone, cheaply: ``{"save_wait", "time_to": {level: samples}, "restore", "restart"}``."""
        with self._cv:
            return {"save_wait": self._save_wait.to_json(),
                    "time_to": {lvl: s.to_json() for lvl, s in self._time_to.items()},
                    "restore": self._restore.to_json(), "restart": self._restart.to_json()}

    def lag(self) -> dict[str, dict[str, Lag | None]]:
        """The status's ``lag`` alone, cheaply: per branch and level, how far behind training."""
        with self._cv:
            return {b: {lvl: None if x is None else Lag(steps=int(x["steps"]), seconds=x["seconds"])
                        for lvl, x in self._lag_of(b).items()} for b in self._training}

    def newest_version(self) -> str | None:
        """Id of the newest version this process saved, or ``None``."""
        with self._cv:
            return self._staged["version"] if self._staged else None

    def current(self) -> Status:
        """The status object as it would be written now (see the module docstring)."""
        meter = self._meter()
        with self._cv:  # copied under the lock the save path takes; validated after it is let go
            doc = {
                "schema_version": STATUS_SCHEMA,
                "pid": os.getpid(),
                "writer": self._writer,
                "started_at": self._started_at,
                "updated_at": self._clock(),
                "closed": self._closed,
                "levels": list(self._levels),
                "staged": dict(self._staged) if self._staged else None,
                "training": {b: dict(t) for b, t in self._training.items()},
                "newest": {b: {lvl: dict(n) for lvl, n in levels.items()} for b, levels in self._newest.items()},
                "lag": {b: self._lag_of(b) for b in self._training},
                "lag_history": list(self._lag_history),
                "save_wait": self._save_wait.to_json(),
                "time_to": {lvl: s.to_json() for lvl, s in self._time_to.items()},
                "restore": self._restore.to_json(),
                "restart": self._restart.to_json(),
                "queues": {lvl: len(ids) for lvl, ids in self._pending.items()},
                "versions": {vid: {**v, "levels": {k: dict(x) for k, x in v["levels"].items()}}
                             for vid, v in self._versions.items()},
                "errors": list(self._errors),
                "meter": meter,
                "advice": self._advice,
            }
        return Status.model_validate(doc)

    # ------------------------------------------------------------------ writing

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._dirty or self._closed)
                if self._closed:
                    return
                delay = self._last_write + self._interval - time.monotonic()
                # Rate limit: a burst of events within the interval becomes one write at its end.
                if delay > 0 and self._cv.wait_for(lambda: self._closed, timeout=delay):
                    return
                self._dirty = False
            self._write()

    def _write(self) -> None:
        assert self._write_fn is not None
        data = self.current().model_dump_json().encode()
        self._last_write = time.monotonic()
        try:
            self._write_fn(data)
        except TierCacheError as e:
            # A viewer's aid, never a reason to disturb training: say it once.
            if not self._write_failed:
                log.warning("could not write %s (viewers will see an older status): %s", STATUS_KEY, e)
            self._write_failed = True

    def close(self) -> None:
        """Stop the writer and write the final status (marked ``closed``) if anything was recorded."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._write()


def public_name(err: BaseException) -> str:
    """The name of ``err``'s first class in its MRO that is not private (``_Gone`` -> ``AgentUnavailableError``)."""
    return next(c.__name__ for c in type(err).__mro__ if not c.__name__.startswith("_"))


def read_status(data: bytes | None) -> Status | None:
    """Parse a stored status object; ``None`` if there is none or it is not one (a hint, never an error).

    A document an older version wrote loads: a field it lacks takes its default (see
    :class:`tiercache.runtime.Status`).
    """
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError as e:
        log.debug("ignoring an unreadable %s: %s", STATUS_KEY, e)
        return None
    if not isinstance(doc, dict) or doc.get("schema_version") != STATUS_SCHEMA:
        return None
    try:
        return Status.model_validate(doc)
    except ValidationError as e:
        log.debug("ignoring a malformed %s: %s", STATUS_KEY, e)
        return None


__all__ = ["STATUS_KEY", "Samples", "StatusRecorder", "public_name", "read_status"]
