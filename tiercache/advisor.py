"""The checkpoint-interval advisor: how often to save so that the most of the job's time trains.

Saving too often spends training time on saves; too rarely, a failure throws more work away.
The functions here are the classic answers as pure functions of a few figures, all in seconds:

* ``M``, **mttf**: mean time to failure of the whole job (``N`` GPUs each with an MTBF of ``m``
  fail, together, every ``m / N`` on average).
* ``δ`` (Young, Daly) or ``Ts`` (2410.18124), **save_wait**: the training time one checkpoint
  costs (how long ``save()`` blocks the loop: a copy into RAM here, not the whole write).
* ``L``, **time_to_level**: from ``save()`` until the version is durable at the level a restart
  would resume from. A failure inside that window loses the previous interval as well, so on
  average a failure loses ``T/2 + L`` of work, not ``T/2``.
* ``R``, **restore** plus **restart**: the time from a failure until training runs again (the job
  being rescheduled and started, then the newest durable version read back).

:func:`plan` combines them: the advised interval is the availability-optimal one of
:func:`availability_optimal` with the recovery time ``Tr = restart + restore + L``, kept within the
user's bounds and never shorter than ``L`` (a level cannot be reached more often than it takes to
reach it). Every interval this module returns is a **period**: the wall time from the start of
one save to the start of the next, the save included. :class:`Advisor` does the same inside a
training loop from figures it keeps measuring (CheckFreq's idea: Mohan et al., FAST '21).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from tiercache.errors import InvalidArgumentError
from tiercache.handle import TIER_LEVEL
from tiercache.status import Samples

Source = Literal["measured", "estimated", "assumed", "given"]
#: The tier whose speed tells how long reaching (or restoring from) a level takes.
LEVEL_TIER = {"staged": "ram", **{lvl: tier for tier, lvl in TIER_LEVEL.items()}}
#: Multiples of the advised interval at which :meth:`Plan.table` shows the expected goodput.
TABLE_FACTORS = (0.25, 0.5, 2.0, 4.0)
#: Points of :meth:`Plan.curve` (log-spaced).
CURVE_POINTS = 48


# ---------------------------------------------------------------------------------------------
# The formulas


def young(save_cost: float, mttf: float) -> float:
    """Young's first-order optimum compute time between two checkpoints: ``sqrt(2 δ M)``.

    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 1974.

    Args:
        save_cost: ``δ``, the time one checkpoint takes away from the computation.
        mttf: ``M``, the mean time between failures.

    Returns:
        The compute time between the end of one checkpoint and the start of the next (add
        ``δ`` for the period).
    """
    return math.sqrt(2.0 * save_cost * mttf)


def daly(save_cost: float, mttf: float) -> float:
    """Daly's higher-order optimum compute time between two checkpoints.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    FGCS 2006: ``sqrt(2 δ M) [1 + (1/3) sqrt(δ / 2M) + (1/9) (δ / 2M)] - δ`` for ``δ < 2M``, else
    ``M``. With ``M = 24 h`` and ``δ = 5 min`` it gives about 117 min (Young's: 120 min).

    Args:
        save_cost: ``δ``, the time one checkpoint (restart dump) takes.
        mttf: ``M``, the mean time to interrupt.

    Returns:
        The compute time between checkpoints (add ``δ`` for the period).
    """
    if save_cost >= 2.0 * mttf:
        return mttf
    x = save_cost / (2.0 * mttf)
    return math.sqrt(2.0 * save_cost * mttf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_cost


def availability_optimal(save_time: float, mttf: float, recovery: float) -> float:
    """The checkpoint interval that maximises availability: ``Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)``.

    N. R. Saxena, S. Hukerikar, M. Blaz, S. Raj (NVIDIA), "Optimal Checkpoint Interval with
    Availability as an Objective Function", arXiv 2410.18124. It is the maximum of
    :func:`availability`; for ``Ts << Tr << Tf`` it tends to Young's ``sqrt(2 Tf Ts)``.

    Args:
        save_time: ``Ts``, the checkpoint save time: how long one checkpoint keeps the job from
            training.
        mttf: ``Tf``, the mean time to failure.
        recovery: ``Tr``, the recovery time after a failure, until training runs again.

    Returns:
        ``Tc``, the checkpoint interval: the period from the start of one checkpoint to the start
        of the next, ``Ts`` included.
    """
    return save_time + math.sqrt(2.0 * (mttf + recovery) * save_time + save_time**2)


def availability(interval: float, save_time: float, mttf: float, recovery: float) -> float:
    """The fraction of time spent on useful training at checkpoint interval ``Tc``.

    ``A(Tc) = (1 - Ts / Tc) · Tf / (Tf + Tr + Tc / 2)``: of each interval, ``Ts`` goes to the save;
    each failure, once per ``Tf`` of running on average, costs ``Tr`` to recover and half an
    interval of work redone. Its maximum over ``Tc`` is :func:`availability_optimal`.

    Args:
        interval: ``Tc``, the period between checkpoint starts.
        save_time: ``Ts``, the checkpoint save time.
        mttf: ``Tf``, the mean time to failure.
        recovery: ``Tr``, the recovery time.

    Returns:
        The availability (goodput fraction) in ``[0, 1]``; 0 when ``Tc <= Ts``.
    """
    if interval <= save_time or interval <= 0:
        return 0.0
    return (1.0 - save_time / interval) * mttf / (mttf + recovery + interval / 2.0)


# ---------------------------------------------------------------------------------------------
# A plan from figures


@dataclass(frozen=True)
class Figure:
    """One input of a plan: seconds, and where the number comes from.

    Attributes:
        seconds: The value.
        source: ``measured`` (timed by the cache), ``estimated`` (from measured speeds and the
            newest version's size), ``assumed`` (a default) or ``given`` (by the user).
        note: How it was obtained.
    """

    seconds: float
    source: Source
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """``{"seconds", "source", "note"}``."""
        return {"seconds": self.seconds, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs; ``None`` where it is not known.

    Attributes:
        level: The durability level a restart resumes from.
        mttf: Mean time to failure of the job.
        save_wait: The training time one save costs.
        time_to_level: From ``save()`` until the version is at ``level``.
        restore: Time to read the newest version back from ``level``'s tier.
        restart: Time from a failure until the job runs again, before its restore.
    """

    level: str
    mttf: Figure | None
    save_wait: Figure | None
    time_to_level: Figure | None
    restore: Figure | None
    restart: Figure | None

    def missing(self) -> list[str]:
        """Names of the inputs that are not known."""
        return [n for n in ("mttf", "save_wait", "time_to_level", "restore", "restart") if getattr(self, n) is None]

    def to_json(self) -> dict[str, Any]:
        """``{"level", name: Figure.to_json() | null, ...}``."""
        out: dict[str, Any] = {"level": self.level}
        for n in ("mttf", "save_wait", "time_to_level", "restore", "restart"):
            f = getattr(self, n)
            out[n] = None if f is None else f.to_json()
        return out


@dataclass(frozen=True)
class Plan:
    """The advised interval and the figures around it (all intervals are periods, in seconds).

    Attributes:
        inputs: What the plan was computed from (every figure known).
        interval: The advised interval.
        optimum: The availability-optimal interval before bounds.
        young: Young's interval (``sqrt(2 δ M) + δ``).
        daly: Daly's higher-order interval (plus ``δ``).
        bound: Which bound set :attr:`interval` (``min_interval``, ``max_interval``,
            ``time_to_level``), or ``None`` if it is the optimum.
        save_time: ``Ts``: the save wait used.
        mttf: ``Tf``: the MTTF used.
        recovery: ``Tr``: restart + restore + time to level.
        min_interval: The lower bound given.
        max_interval: The upper bound given, or ``None``.
    """

    inputs: PlanInputs
    interval: float
    optimum: float
    young: float
    daly: float
    bound: str | None
    save_time: float
    mttf: float
    recovery: float
    min_interval: float = 0.0
    max_interval: float | None = None

    def goodput_at(self, interval: float) -> float:
        """Expected fraction of time that trains, saving every ``interval`` seconds (see :func:`availability`)."""
        return availability(interval, self.save_time, self.mttf, self.recovery)

    @property
    def goodput(self) -> float:
        """Expected goodput at the advised interval."""
        return self.goodput_at(self.interval)

    def table(self) -> list[tuple[str, float, float]]:
        """``(label, interval, goodput)`` at the advised interval, a few multiples, Young's and Daly's."""
        rows = [("advised", self.interval, self.goodput)]
        rows += [(f"{f:g}x advised", self.interval * f, self.goodput_at(self.interval * f)) for f in TABLE_FACTORS]
        rows += [("Young", self.young, self.goodput_at(self.young)), ("Daly", self.daly, self.goodput_at(self.daly))]
        return sorted(rows, key=lambda r: r[1])

    def curve(self, points: int = CURVE_POINTS) -> list[tuple[float, float]]:
        """``(interval, goodput)`` from a tenth to ten times the advised interval, log-spaced."""
        lo, hi = max(self.interval / 10.0, 1e-3), max(self.interval * 10.0, 1e-2)
        step = (math.log(hi) - math.log(lo)) / (points - 1)
        xs = [math.exp(math.log(lo) + i * step) for i in range(points)]
        return [(x, self.goodput_at(x)) for x in xs]

    def to_json(self) -> dict[str, Any]:
        """Every figure: ``{"interval_s", "optimum_s", "young_s", "daly_s", "bound", "goodput",
        "recovery_s", "min_interval_s", "max_interval_s", "inputs", "table": [{"label",
        "interval_s", "goodput"}], "curve": [[interval_s, goodput], ...]}``.
        """  # noqa: D205
        return {
            "interval_s": self.interval,
            "optimum_s": self.optimum,
            "young_s": self.young,
            "daly_s": self.daly,
            "bound": self.bound,
            "goodput": self.goodput,
            "recovery_s": self.recovery,
            "min_interval_s": self.min_interval,
            "max_interval_s": self.max_interval,
            "inputs": self.inputs.to_json(),
            "table": [{"label": lbl, "interval_s": t, "goodput": g} for lbl, t, g in self.table()],
            "curve": [list(p) for p in self.curve()],
        }


def plan(inputs: PlanInputs, *, min_interval: float = 0.0, max_interval: float | None = None) -> Plan:
    """Advise a checkpoint interval (see the module docstring for the model).

    Args:
        inputs: The figures; all must be known.
        min_interval: Never advise a shorter interval.
        max_interval: Never advise a longer one (``None``: no bound).

    Returns:
        The plan.

    Raises:
        InvalidArgumentError: If an input is missing or not a finite number >= 0, the MTTF is
            not positive, or the bounds are inverted.
    """
    missing = inputs.missing()
    if missing:
        raise InvalidArgumentError(f"cannot advise an interval without {', '.join(missing)}: "
                                   f"nothing measured it yet, so give it (see `tiercache plan --help`)")
    figures = {n: getattr(inputs, n).seconds for n in ("mttf", "save_wait", "time_to_level", "restore", "restart")}
    for name, value in figures.items():
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgumentError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    if figures["mttf"] <= 0:
        raise InvalidArgumentError("mttf must be positive")
    if max_interval is not None and max_interval < min_interval:
        raise InvalidArgumentError(f"max_interval ({max_interval:g} s) is below min_interval ({min_interval:g} s)")
    mttf, save, ttl = figures["mttf"], figures["save_wait"], figures["time_to_level"]
    recovery = figures["restart"] + figures["restore"] + ttl
    optimum = availability_optimal(save, mttf, recovery)
    interval, bound = optimum, None
    for floor, name in ((ttl, "time_to_level"), (min_interval, "min_interval")):
        if interval < floor:
            interval, bound = floor, name
    if max_interval is not None and interval > max_interval:
        interval, bound = max_interval, "max_interval"
    return Plan(inputs, interval, optimum, young(save, mttf) + save, daly(save, mttf) + save, bound,
                save, mttf, recovery, min_interval, max_interval)


# ---------------------------------------------------------------------------------------------
# Figures from what a cache measured


def level_tier(level: str, tiers: Sequence[str]) -> str | None:
    """The tier whose speed tells how long ``level`` takes to reach or restore from (``None`` if none)."""
    if level == "durable":
        return next((t for t in tiers if t != "ram"), None)
    tier = LEVEL_TIER.get(level)
    return tier if tier in tiers else None


def snapshot_rate(snapshot: Mapping[str, Any]) -> Callable[[str, str], float | None]:
    """``rate(tier, direction)`` over a meter snapshot (``ThroughputMeter.snapshot()``) instead of a live meter."""

    def rate(tier: str, direction: str) -> float | None:
        entry = dict(dict(snapshot.get("tiers") or {}).get(tier) or {}).get(direction)
        bps = entry.get("bps") if isinstance(entry, Mapping) else None
        return float(bps) if isinstance(bps, int | float) and bps > 0 else None

    return rate


def _ewma(samples: object) -> tuple[float, int, float | None] | None:
    """``(ewma, count, time of the newest sample or None)`` of a :meth:`Samples.to_json`, or ``None``."""
    if not isinstance(samples, Mapping):
        return None
    value, count = samples.get("ewma"), samples.get("count")
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0 and isinstance(count, int):
        recent = samples.get("recent")
        newest = recent[-1][0] if isinstance(recent, list) and recent and isinstance(recent[-1], list) else None
        return float(value), count, float(newest) if isinstance(newest, int | float) else None
    return None


def when(t: float) -> str:
    """A Unix time as the notes of figures show it: ``2026-11-27 03:12:05 UTC``."""
    return f"{datetime.fromtimestamp(t, UTC):%Y-%m-%d %H:%M:%S} UTC"


def _by_size(nbytes: int | None, bps: float | None, what: str) -> Figure | None:
    if nbytes is None or not bps:
        return None
    return Figure(nbytes / bps, "estimated", f"newest version's size / {what}")


def measured_inputs(
    *,
    level: str,
    tiers: Sequence[str],
    status: Mapping[str, Any] | None,
    rate: Callable[[str, str], float | None],
    nbytes: int | None,
    mttf: Figure | None,
    restart: Figure,
    given: Mapping[str, float] | None = None,
) -> PlanInputs:
    """Gather a plan's inputs from what a cache measured, each with its source.

    Args:
        level: The level a restart resumes from.
        tiers: The cache's tiers.
        status: The saving process's status (:mod:`tiercache.status`), or ``None``; its
            ``save_wait`` and ``time_to`` measurements are used.
        rate: ``rate(tier, direction)``: the meter's smoothed bytes/s, or ``None``.
        nbytes: Size of the newest version (for estimates from speeds), or ``None``.
        mttf: The job's MTTF, or ``None`` if unknown.
        restart: Time from a failure until the job runs again: given, configured, or a default
            (source ``assumed``), which restarts the status measured replace.
        given: Figures the user gave (``save_wait``, ``time_to_level``, ``restore``); they win.

    Returns:
        The inputs; a figure that nothing measured, estimated or gave is ``None``.
    """
    given = dict(given or {})
    status = status or {}
    tier = level_tier(level, tiers)

    def pick(name: str, *candidates: Callable[[], Figure | None]) -> Figure | None:
        if name in given:
            return Figure(given[name], "given")
        return next((f for f in (c() for c in candidates) if f is not None), None)

    def measured(samples: object, what: str) -> Figure | None:
        got = _ewma(samples)
        if got is None:
            return None
        newest = f", newest {when(got[2])}" if got[2] is not None else ""
        return Figure(got[0], "measured", f"EWMA of {got[1]} {what}{newest}")

    ram = "ram" if "ram" in tiers else None
    save_wait = pick("save_wait", lambda: measured(status.get("save_wait"), "saves"),
                     lambda: _by_size(nbytes, rate(ram, "write") if ram else None, "RAM copy speed"))
    time_to = status.get("time_to") if isinstance(status.get("time_to"), Mapping) else {}
    time_to_level = pick(
        "time_to_level", lambda: measured(time_to.get(level), f"saves reaching {level}"),
        lambda: _by_size(nbytes, rate(tier, "write") if tier else None, f"{tier} write speed"),
    )
    restore = pick(
        "restore", lambda: measured(status.get("restore"), "restores"),
        lambda: _by_size(nbytes, rate(tier, "read") if tier else None, f"{tier} read speed"),
        lambda: _by_size(nbytes, rate(tier, "write") if tier else None, f"{tier} write speed (no read measured)"),
    )
    if restart.source == "assumed":
        restart = measured(status.get("restart"), "restarts (the node agent saw the trainers leave and return)"
                           ) or restart
    return PlanInputs(level, mttf, save_wait, time_to_level, restore, restart)


# ---------------------------------------------------------------------------------------------
# In the training loop


class Advisor:
    """Tells a training loop when to save, re-tuned as the measured costs change.

    Call :meth:`should_save` once per step, before deciding to save; it times the steps itself
    (CheckFreq's idea): a step after which the loop did not save gives the step time, a step
    after which it saved gives the save's cost to training (its extra time over a plain step).
    The advised interval (:func:`plan`) is then turned into a number of steps. Until the advisor
    has timed a saving step, it uses the save wait the cache measured in ``save()``. Make it with
    ``cache.advisor(...)``.

    Args:
        inputs: Returns the cache's current figures (:func:`measured_inputs`).
        min_interval: Never save more often than every this many seconds.
        max_interval: Never let more than this many seconds pass between saves (``None``: no bound).
        clock: Monotonic seconds (tests pass a fake one).
        publish: Called after every step with the step and the current plan's JSON (or ``None``);
            the cache publishes both in its status for ``tiercache ui``.
    """

    def __init__(
        self,
        inputs: Callable[[], PlanInputs],
        *,
        min_interval: float = 0.0,
        max_interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        publish: Callable[[int, Mapping[str, Any] | None], None] | None = None,
    ) -> None:
        if max_interval is not None and max_interval < min_interval:
            raise InvalidArgumentError(f"max_interval ({max_interval:g} s) is below min_interval ({min_interval:g} s)")
        self._inputs = inputs
        self._min = min_interval
        self._max = max_interval
        self._clock = clock
        self._publish = publish
        self._step = Samples()
        self._cost = Samples()
        self._prev: float | None = None
        self._saved_prev = False
        self._last_saved: int | None = None
        self._plan: Plan | None = None

    @property
    def step_time(self) -> float | None:
        """Smoothed seconds of a step without a save, once measured."""
        return self._step.ewma

    @property
    def save_cost(self) -> float | None:
        """Smoothed extra seconds of a step after which the loop saved, once measured."""
        return self._cost.ewma

    @property
    def interval_steps(self) -> int | None:
        """The advised interval in steps, once a plan and the step time are known."""
        if self._plan is None or not self._step.ewma:
            return None
        return max(1, round(self._plan.interval / self._step.ewma))

    def plan(self) -> Plan | None:
        """The current plan (from the last :meth:`should_save`), or ``None`` while a figure is missing."""
        return self._plan

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: always at the first call, then every :attr:`interval_steps` steps.

        Args:
            step: The training step about to be saved or not.

        Returns:
            ``True`` to save now; the advisor then counts the next step's extra time as the
            save's cost, so call ``save()`` when it says so.
        """
        now = self._clock()
        if self._prev is not None:
            elapsed = now - self._prev
            if not self._saved_prev:
                self._step.add(now, elapsed)
            elif self._step.ewma is not None:
                self._cost.add(now, elapsed - self._step.ewma)
        self._prev = now
        self._plan = self._make_plan()
        k = self.interval_steps
        save = self._last_saved is None or (k is not None and step - self._last_saved >= k)
        if save:
            self._last_saved = step
        self._saved_prev = save
        if self._publish is not None:
            self._publish(step, None if self._plan is None else self.to_json())
        return save

    def _make_plan(self) -> Plan | None:
        inputs = self._inputs()
        if self._cost.ewma is not None:
            inputs = replace(inputs, save_wait=Figure(self._cost.ewma, "measured",
                                                      f"extra time of {self._cost.count} saving steps (advisor)"))
        if inputs.save_wait is None or inputs.mttf is None:
            return None
        # In the loop, a figure not measured yet counts as nothing until it is.
        unknown = Figure(0.0, "assumed", "not measured yet")
        inputs = replace(inputs, time_to_level=inputs.time_to_level or unknown, restore=inputs.restore or unknown,
                         restart=inputs.restart or unknown)
        return plan(inputs, min_interval=self._min, max_interval=self._max)

    def to_json(self) -> dict[str, Any]:
        """The current plan's JSON plus ``step_time_s``, ``save_cost_s`` and ``interval_steps``."""
        out = self._plan.to_json() if self._plan is not None else {}
        out.update(step_time_s=self.step_time, save_cost_s=self.save_cost, interval_steps=self.interval_steps)
        return out


__all__ = [
    "Advisor",
    "Figure",
    "Plan",
    "PlanInputs",
    "availability",
    "availability_optimal",
    "daly",
    "level_tier",
    "measured_inputs",
    "plan",
    "snapshot_rate",
    "young",
]
