"""Retention helpers: small composable rules that say which versions a tier must keep.

Each rule looks at a list of :class:`~tiercache.policy.base.VersionView` and returns the ids it
wants kept; :class:`KeepAny` keeps the union of several rules. Rules are pure functions of their
input (no I/O, no clock), so a policy can ask them under capacity pressure and a test can check
them over synthetic versions. They follow orbax's preservation policies: a version is expendable
only when no rule keeps it, and branch heads and tags (``pinned``) are always kept.

In a policy's parameters (``policies/*.toml``) a retention is a table whose keys name the rules::

    retention = { latest = 3, every_steps = 1000, best = { metric = "loss", n = 2, mode = "min" } }
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from tiercache.errors import ConfigError
from tiercache.policy.base import VersionView

Mode = Literal["min", "max"]


@runtime_checkable
class Retention(Protocol):
    """A rule choosing the versions to keep."""

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the ids of ``versions`` this rule keeps."""
        ...


def _newest_first(versions: Sequence[VersionView]) -> list[VersionView]:
    # Ids are sortable by creation time; created_at first so hand-made test ids still order by time.
    return sorted(versions, key=lambda v: (v.created_at, v.id), reverse=True)


class KeepPinned:
    """Keep every branch head and tagged version."""

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the ids of the pinned versions."""
        return {v.id for v in versions if v.pinned}

    def __repr__(self) -> str:
        return "KeepPinned()"


class KeepLatest:
    """Keep the newest ``n`` versions.

    Args:
        n: How many to keep (at least 1).

    Raises:
        ConfigError: If ``n`` is not a positive int.
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int(n, "n")

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the ids of the newest ``n`` versions."""
        return {v.id for v in _newest_first(versions)[: self.n]}

    def __repr__(self) -> str:
        return f"KeepLatest({self.n})"


class KeepEveryNSteps:
    """Keep the versions whose step is a multiple of ``n`` (long-term milestones).

    Args:
        n: Step interval (at least 1).

    Raises:
        ConfigError: If ``n`` is not a positive int.
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int(n, "n")

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the ids of the versions at a step that is a multiple of ``n``."""
        return {v.id for v in versions if v.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEveryNSteps({self.n})"


class KeepBest:
    """Keep the ``n`` versions with the best value of a numeric ``meta`` metric.

    Versions without the metric, or with a value that is not a finite number, are never kept by
    this rule. Among equal values the newer version wins.

    Args:
        metric: Key in each version's ``meta`` (``"loss"``, ``"eval_acc"``...).
        n: How many to keep (at least 1).
        mode: ``"min"`` when lower is better (a loss), ``"max"`` when higher is (an accuracy).

    Raises:
        ConfigError: If an argument is invalid.
    """

    def __init__(self, metric: str, n: int = 1, mode: Mode = "min") -> None:
        if not isinstance(metric, str) or not metric:
            raise ConfigError(f"field 'metric': expected a meta key such as \"loss\", got {metric!r}")
        if mode not in ("min", "max"):
            raise ConfigError(f"field 'mode': expected \"min\" or \"max\", got {mode!r}")
        self.metric = metric
        self.n = _positive_int(n, "n")
        self.mode: Mode = mode

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the ids of the ``n`` best versions that carry the metric."""
        scored = [(v, _metric(v, self.metric)) for v in _newest_first(versions)]
        ranked = [(v, x) for v, x in scored if x is not None]
        # sorted() is stable, so among equal values the newest (first in ranked) stays ahead.
        ranked.sort(key=lambda vx: vx[1] if self.mode == "min" else -vx[1])  # type: ignore[operator]
        return {v.id for v, _ in ranked[: self.n]}

    def __repr__(self) -> str:
        return f"KeepBest({self.metric!r}, n={self.n}, mode={self.mode!r})"


class KeepAny:
    """Keep every version that at least one of ``rules`` keeps.

    Args:
        *rules: The rules to combine.
    """

    def __init__(self, *rules: Retention) -> None:
        self.rules: tuple[Retention, ...] = rules

    def keep(self, versions: Sequence[VersionView]) -> set[str]:
        """Return the union of what the rules keep."""
        out: set[str] = set()
        for rule in self.rules:
            out |= rule.keep(versions)
        return out

    def __repr__(self) -> str:
        return f"KeepAny({', '.join(map(repr, self.rules))})"


_RULE_KEYS = ("latest", "every_steps", "best")


def retention_from_params(params: Mapping[str, Any] | None, *, field: str = "retention") -> KeepAny:
    """Build a retention from a policy parameter table; branch heads and tags are always kept.

    Args:
        params: ``None`` (keep only pinned versions) or a table with any of ``latest`` (int),
            ``every_steps`` (int), ``best`` (a table with ``metric``, ``n``, ``mode``).
        field: Where the table sits in the caller's config, for error messages.

    Returns:
        :class:`KeepPinned` combined with the rules the table names.

    Raises:
        ConfigError: If a key is unknown or a value is invalid (the message names the field).
    """
    rules: list[Retention] = [KeepPinned()]
    if params is None:
        return KeepAny(*rules)
    if not isinstance(params, Mapping):
        raise ConfigError(f"field '{field}': expected a table such as {{ latest = 3 }}, got {params!r}")
    unknown = sorted(set(params) - set(_RULE_KEYS))
    if unknown:
        raise ConfigError(f"field '{field}.{unknown[0]}': unknown rule; use {', '.join(_RULE_KEYS)}")
    if "latest" in params:
        rules.append(KeepLatest(_positive_int(params["latest"], f"{field}.latest")))
    if "every_steps" in params:
        rules.append(KeepEveryNSteps(_positive_int(params["every_steps"], f"{field}.every_steps")))
    if "best" in params:
        rules.append(_best_from_params(params["best"], f"{field}.best"))
    return KeepAny(*rules)


def _best_from_params(best: object, field: str) -> KeepBest:
    if not isinstance(best, Mapping):
        example = '{ metric = "loss", n = 2 }'
        raise ConfigError(f"field '{field}': expected a table such as {example}, got {best!r}")
    extra = sorted(set(best) - {"metric", "n", "mode"})
    if extra:
        raise ConfigError(f"field '{field}.{extra[0]}': unknown key; use metric, n, mode")
    metric, mode = best.get("metric"), best.get("mode", "min")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"field '{field}.metric': expected a meta key such as \"loss\", got {metric!r}")
    if mode not in ("min", "max"):
        raise ConfigError(f"field '{field}.mode': expected \"min\" or \"max\", got {mode!r}")
    return KeepBest(metric, _positive_int(best.get("n", 1), f"{field}.n"), mode)


def _positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"field '{field}': expected an int >= 1, got {value!r}")
    return value


def _metric(version: VersionView, key: str) -> float | None:
    value = version.meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


__all__ = [
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLatest",
    "KeepPinned",
    "Retention",
    "retention_from_params",
]
