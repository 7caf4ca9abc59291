"""Built-in policies and the registry that finds a policy by name.

``load_policy(cfg)`` accepts a preset shipped in ``policies/<name>.toml``, a registered name
(``write-through``, ``throughput-adaptive``), a ``package.module:Class`` path, or a name
registered by another package under the entry-point group ``tiercache.policies``.

Both built-ins are pure: every decision is a function of the :class:`PolicyContext` it is given
(no clock, no I/O, no state carried between calls), so the unit tests replay any situation
from synthetic numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import tomllib
from collections.abc import Callable, Mapping
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import ValidationError

from tiercache.codecs import BGZSTD, RAW, ZSTD, codec_names
from tiercache.config import PolicyConfig
from tiercache.errors import ConfigError
from tiercache.policy.base import (
    OnFull,
    Placement,
    Policy,
    PolicyContext,
    TierPlan,
    TierStats,
    VersionView,
)
from tiercache.policy.retention import KeepAny, retention_from_params

_REGISTRY: dict[str, Callable[..., Policy]] = {}
_ON_FULL = ("wait", "skip", "evict")
_MB = 1e6

Compression = Literal["auto", "on", "off"]


def register(name: str) -> Callable[[type], type]:
    """Class decorator registering a policy under ``name``."""

    def deco(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_names() -> list[str]:
    """Names of the registered built-in policies."""
    return sorted(_REGISTRY)


def _check_on_full(value: object, policy: str) -> OnFull:
    if value not in _ON_FULL:
        raise ConfigError(f"{policy}: field 'params.on_full': expected wait, skip or evict, got {value!r}")
    return value  # type: ignore[return-value]


@register("write-through")
class WriteThrough:
    """Every version to every durable tier, raw; keep the newest ``keep`` versions per tier.

    Args:
        keep: Versions kept per tier when a tier is over capacity (branch heads and tags are
            always kept on top of these). Set (as the shipped preset does), it is a retention
            the user chose: it may prune a version's last durable copy. Left out, a tier over
            capacity drops only versions another durable tier holds (the keep rule).
        on_full: What ``save()`` does when the RAM arena is full: ``wait`` (default) for older
            versions to finish writing, or ``skip`` this version.

    Raises:
        ConfigError: If a parameter is invalid.
    """

    def __init__(self, keep: int | None = None, on_full: OnFull = "wait") -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"write-through: field 'params.keep': expected an int >= 1, got {keep!r}")
        self.keep = 3 if keep is None else keep
        #: The user-set rule under which :meth:`evict` may name a last durable copy (see :class:`Policy`).
        self.retention_rule: str | None = None if keep is None else f"write-through keep = {keep}"
        self._on_full: OnFull = _check_on_full(on_full, "write-through")

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        """Place the version on every configured durable tier, fastest first, uncompressed."""
        durable = [t for t in ctx.tiers.values() if t.durable]
        return Placement(tuple(TierPlan(t.name) for t in durable))

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        """Oldest unpinned versions on ``tier`` beyond the newest ``keep`` (unless ``keep`` was set: held elsewhere)."""
        on_tier = [v for v in ctx.versions if tier in v.tiers]
        excess = on_tier[: max(0, len(on_tier) - self.keep)]
        return [v.id for v in excess if not v.pinned and (self.retention_rule or _elsewhere(v, tier, ctx))]

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        """Wait for the engine to free arena space (or skip, if configured)."""
        return self._on_full


def _elsewhere(v: VersionView, tier: str, ctx: PolicyContext) -> bool:
    """Whether a durable tier other than ``tier`` holds ``v`` whole."""
    return any(n != tier and n in ctx.tiers and ctx.tiers[n].durable for n in v.tiers)


def _mbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / _MB:.1f}" if seconds > 0 else "inf"


def compression_wins(tier_bps: float, encode_bps: float, ratio: float) -> bool:
    """Whether writing a byte encoded beats writing it raw on a tier of ``tier_bps``.

    The rule of docs/design.md section 5, per raw byte: encode time plus encoded bytes over the tier
    speed must beat raw bytes over the tier speed, ``1/encode + 1/(ratio*tier) < 1/tier``.
    Encoding and transfers of different chunks overlap in the engine, so this is conservative:
    it only compresses when compression wins even without that overlap.

    Args:
        tier_bps: Observed write speed of the tier (stored bytes/s).
        encode_bps: Observed encode speed of the codec (raw bytes/s).
        ratio: Observed ratio (raw bytes per encoded byte).
    """
    return 1.0 / encode_bps + 1.0 / (ratio * tier_bps) < 1.0 / tier_bps


@register("throughput-adaptive")
class ThroughputAdaptive:
    """Placement driven by the throughput the meter observes on each tier (the default policy).

    * Every version is staged in RAM and written to every durable tier while each keeps up.
    * A tier keeps up while the rate at which saves arrive (bytes of the last ``ingest_window``
      saves over the time they span) fits in ``headroom`` of its observed write speed, and,
      for a remote tier, writing every pending version in order would never leave it more than
      ``max_remote_lag_s`` behind the newest version it holds. When it does not keep up, a
      version with a newer one pending for that tier is skipped there (coalescing): only the
      newest pending version is written, which is also the fastest way to a fresh remote copy.
      Until a tier's speed is measured, only the oldest and the newest pending versions are
      written. Pinned versions (branch heads, tags) are never skipped this way.
    * With ``direct_to_remote``, a local tier (disk) is skipped, so versions go RAM -> S3
      directly, when it cannot make room for the version even after eviction, or when it is
      measured slower than the remote tier; one version is still written to it every
      ``disk_probe_s`` seconds so its speed stays measured.
    * Each tier gets a codec only when :func:`compression_wins` on the measured numbers; until
      the codec and the tier are measured, versions go raw (the engine measures a codec on a
      sample of a version, never by compressing a whole one: :mod:`tiercache.pipeline.probe`).
      ``bgzstd/1`` is the candidate for mostly floating-point versions, ``zstd/1`` otherwise,
      unless ``codec`` names one.
    * Under capacity pressure a tier drops the oldest versions another durable tier also holds;
      with a ``retention`` set, also the oldest versions it does not keep, first, even a last
      durable copy (they are pruned). Never a pinned one.

    Args:
        max_remote_lag_s: Bound on the time the remote tier may go without a copy of a version
            newer than the one it holds; above it, intermediate versions are skipped.
        headroom: Share (0, 1] of a tier's measured speed that saves may use before it counts
            as not keeping up.
        compression: ``auto`` (measure and decide per tier), ``on`` (always the candidate
            codec) or ``off`` (always raw).
        codec: The candidate codec descriptor, or ``None`` to pick by the version's dtypes.
        direct_to_remote: Allow skipping the disk (RAM -> S3 directly) when it is full or slower.
        disk_probe_s: Seconds between probe writes to a disk that is bypassed for being slower.
        ingest_window: How many recent saves the save rate is measured over (>= 2).
        retention: A retention table (see :mod:`tiercache.policy.retention`): the user's rule,
            which may prune versions it does not keep. ``None``: a tier under pressure drops
            only copies another durable tier holds.
        on_full: What ``save()`` does when the RAM arena is full (``wait``, ``skip``, ``evict``).

    Raises:
        ConfigError: If a parameter is invalid (the message names it).
    """

    name = "throughput-adaptive"

    def __init__(
        self,
        max_remote_lag_s: float = 300.0,
        headroom: float = 0.9,
        compression: Compression = "auto",
        codec: str | None = None,
        direct_to_remote: bool = True,
        disk_probe_s: float = 60.0,
        ingest_window: int = 4,
        retention: Mapping[str, Any] | None = None,
        on_full: OnFull = "wait",
    ) -> None:
        self.max_remote_lag_s = self._positive(max_remote_lag_s, "max_remote_lag_s")
        self.headroom = self._positive(headroom, "headroom")
        if self.headroom > 1:
            self._fail("headroom", f"expected a share in (0, 1], got {headroom!r}")
        if compression not in ("auto", "on", "off"):
            self._fail("compression", f"expected auto, on or off, got {compression!r}")
        self.compression: Compression = compression
        if codec is not None and (codec not in codec_names() or codec == RAW):
            known = ", ".join(c for c in codec_names() if c != RAW)
            self._fail("codec", f"expected one of {known}, got {codec!r}")
        self.codec = codec
        if not isinstance(direct_to_remote, bool):
            self._fail("direct_to_remote", f"expected true or false, got {direct_to_remote!r}")
        self.direct_to_remote = direct_to_remote
        self.disk_probe_s = self._positive(disk_probe_s, "disk_probe_s")
        if isinstance(ingest_window, bool) or not isinstance(ingest_window, int) or ingest_window < 2:
            self._fail("ingest_window", f"expected an int >= 2, got {ingest_window!r}")
        self.ingest_window = ingest_window
        try:
            self.retention: KeepAny = retention_from_params(retention, field="params.retention")
        except ConfigError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        #: The user-set rule under which :meth:`evict` may name a last durable copy (see :class:`Policy`).
        self.retention_rule: str | None = None if retention is None else "retention " + ", ".join(
            f"{k} = {v}" for k, v in retention.items())
        self._on_full: OnFull = _check_on_full(on_full, self.name)

    @classmethod
    def _fail(cls, field: str, msg: str) -> NoReturn:
        raise ConfigError(f"{cls.name}: field 'params.{field}': {msg}")

    @classmethod
    def _positive(cls, value: object, field: str) -> float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):  # type: ignore[arg-type, operator]
            cls._fail(field, f"expected a number > 0, got {value!r}")
        return float(value)

    # ------------------------------------------------------------------ placement

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        """Plan every durable tier for ``version``: a codec each, or a skip with its reason.

        Whatever the measurements say, at least one available durable tier takes the version:
        coalescing skips a tier only while another one takes (or holds) the version, and when
        every tier would be skipped, the one that would hold it soonest takes it after all.
        """
        durable = [t for t in ctx.tiers.values() if t.durable]
        reasons: dict[str, str] = {}
        for t in durable:
            if not t.available:
                reasons[t.name] = f"{t.name} unavailable ({t.unavailable or 'not answering'})"
            elif self.direct_to_remote and not t.remote:
                reasons[t.name] = self._bypass_reason(version, t, ctx)
        if not version.pinned:
            # The slowest tier for this version coalesces first, and only while another takes it.
            for t in sorted(durable, key=lambda x: self._eta_key(version, x, ctx), reverse=True):
                if reasons.get(t.name):
                    continue
                others = [o for o in durable if o is not t and (o.name in version.tiers or (
                    not reasons.get(o.name) and o.name not in version.skipped))]
                if others:
                    reasons[t.name] = self._coalesce_reason(version, t, ctx)
        # A tier the version was already skipped for does not take it, whatever it would say now.
        takers = [t for t in durable if not reasons.get(t.name) and t.name not in version.skipped]
        if not takers and not any(t.name in version.tiers for t in durable):
            available = [t for t in durable if t.available]
            candidates = [t for t in available if t.name not in version.skipped] or available
            if candidates:
                reasons[min(candidates, key=lambda x: self._eta_key(version, x, ctx)).name] = ""
        plans = []
        for t in durable:
            reason = reasons.get(t.name, "")
            codec = RAW if reason else self._codec(version, t, ctx)
            plans.append(TierPlan(t.name, codec, skip=bool(reason), reason=reason))
        # Soonest done first; unmeasured tiers keep their configured order after them.
        order = {t.name: i for i, t in enumerate(durable)}
        key = {t.name: self._eta_key(version, t, ctx) for t in durable}
        plans.sort(key=lambda p: (key[p.tier], order[p.tier]))
        return Placement(tuple(plans))

    def _eta_key(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> tuple[bool, float]:
        """Sort key: measured tiers by when they would hold ``v`` (queue included), unmeasured last."""
        eta = self.eta(v, t, ctx)
        return (eta is None, eta or 0.0)

    def eta(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> float | None:
        """Predicted seconds until tier ``t`` holds ``v``: its queue, then ``v``'s own bytes and commit.

        Both terms count per-request latency and bandwidth (see :meth:`TierStats.write_seconds`),
        so a tier whose small fsynced writes make its bytes/s look low is not mistaken for a slow
        one; ``None`` while the tier's speed is not measured.
        """
        own = t.write_seconds(int(v.nbytes / self._ratio(v, t, ctx)))
        queued = t.backlog_seconds()
        if own is None or queued is None:
            return None
        return queued + own

    def _bypass_reason(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> str:
        remotes = [r for r in ctx.tiers.values() if r.durable and r.remote and r.available]
        if not remotes or t.name in v.tiers:
            return ""
        r = min(remotes, key=lambda x: self._eta_key(v, x, ctx))
        if t.capacity is not None:
            evictable = sum(x.nbytes for x in self._eviction_order(t.name, ctx))
            room = t.capacity - t.used_bytes + evictable
            if v.nbytes > room:
                return (f"{t.name} full ({t.used_bytes} of {t.capacity} bytes used, {evictable} evictable; "
                        "eviction keeps branch heads, tags and versions no other durable tier holds): "
                        f"RAM -> {r.name} directly")
        mine, theirs = self.eta(v, t, ctx), self.eta(v, r, ctx)
        # Only a disk that is both slower for this version and not keeping up with the saves is
        # bypassed: while it keeps up, every version gets a local copy at no cost to the others.
        if mine is not None and theirs is not None and theirs < mine and not self._keeps_up(v, t, ctx):
            # Probe now and then so a disk that got fast again is noticed.
            recent = [x.created_at for x in ctx.versions
                      if x.id != v.id and (t.name in x.tiers or t.name in x.pending)]
            if recent and ctx.now - max(recent) < self.disk_probe_s:
                speeds = f"{_mbps(v.nbytes, mine)} < {_mbps(v.nbytes, theirs)} MB/s"
                return (f"{t.name} slower than {r.name} for this version ({speeds}, queues and per-request "
                        f"latency included): RAM -> {r.name} directly")
        return ""

    def _keeps_up(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> bool:
        """Whether ``t`` absorbs saves as fast as they arrive (within ``headroom``), at ``v``'s size."""
        raw = self._raw_seconds(v.nbytes, v, t, ctx)
        ingest = self.ingest_bps(ctx)
        if raw is None or ingest is None:
            return True
        return raw <= 0 or ingest <= self.headroom * v.nbytes / raw

    def _coalesce_reason(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> str:
        pending = list(ctx.pending.get(t.name, ()))
        newer = [i for i in pending if i > v.id]
        if not newer:
            return ""
        newest = max(newer)
        raw = self._raw_seconds(v.nbytes, v, t, ctx)
        if raw is None:
            return f"coalesced: {t.name} speed not measured yet and newer version {newest} is pending"
        # The tier's speed at this version's size: bandwidth and per-request latency together.
        absorbs = v.nbytes / raw if raw > 0 else math.inf
        ingest = self.ingest_bps(ctx)
        if ingest is not None and ingest > self.headroom * absorbs:
            return (f"coalesced: saves arrive at {ingest / _MB:.1f} MB/s, {t.name} absorbs "
                    f"{absorbs / _MB:.1f} MB/s; newer version {newest} is pending")
        if t.remote:
            lag = self.projected_lag(t, ctx, lambda x: self._raw_seconds(x.nbytes, x, t, ctx) or 0.0)
            if lag > self.max_remote_lag_s:
                return (f"coalesced: writing every pending version would leave {t.name} {lag:.0f}s behind "
                        f"(bound {self.max_remote_lag_s:.0f}s); newer version {newest} is pending")
        return ""

    def _raw_seconds(self, nbytes: int, v: VersionView, t: TierStats, ctx: PolicyContext) -> float | None:
        """Predicted seconds to write ``nbytes`` raw bytes of ``v`` to ``t`` (encoded as planned)."""
        return t.write_seconds(int(nbytes / self._ratio(v, t, ctx)))

    def ingest_bps(self, ctx: PolicyContext) -> float | None:
        """Bytes per second at which recent saves arrive, or ``None`` with fewer than two saves.

        Measured over the last ``ingest_window`` versions up to ``ctx.now``, so the rate falls
        when the trainer stops saving.
        """
        recent = sorted(ctx.versions, key=lambda x: (x.created_at, x.id))[-self.ingest_window :]
        if len(recent) < 2:
            return None
        span = max(ctx.now, recent[-1].created_at) - recent[0].created_at
        if span <= 0:
            return math.inf
        return sum(x.nbytes for x in recent[1:]) / span

    def projected_lag(self, t: TierStats, ctx: PolicyContext, seconds: Callable[[VersionView], float]) -> float:
        """The longest ``t`` would lag behind if every pending version were written in order.

        The lag at an instant is the time since the newest version ``t`` holds was saved; it
        peaks right before each pending version lands there.

        Args:
            t: The tier.
            ctx: The context (pending versions, their sizes and save times).
            seconds: How long writing one version to ``t`` takes.
        """
        by_id = {x.id: x for x in ctx.versions}
        queue = [by_id[i] for i in sorted(ctx.pending.get(t.name, ())) if i in by_id]
        held = [x.created_at for x in ctx.versions if t.name in x.tiers]
        prev = max(held) if held else min((x.created_at for x in queue), default=ctx.now)
        clock, worst = ctx.now, ctx.now - prev
        for x in queue:
            clock += seconds(x)
            worst = max(worst, clock - prev)
            prev = x.created_at
        return worst

    # ------------------------------------------------------------------ codecs

    def probe_codecs(self, version: VersionView) -> list[str]:
        """The codec to measure on a sample of ``version`` (its candidate), when compression is ``auto``."""
        return [self._candidate(version)] if self.compression == "auto" else []

    def _candidate(self, v: VersionView) -> str:
        if self.codec is not None:
            return self.codec
        return BGZSTD if v.float_fraction >= 0.5 else ZSTD

    def _codec(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> str:
        if self.compression == "off":
            return RAW
        cand = self._candidate(v)
        if self.compression == "on":
            return cand
        cs = ctx.codecs.get(cand)
        # Never blind: the engine measures an unmeasured codec on a sample of the version first.
        if cs is None or cs.encode_bps is None or cs.ratio is None or t.write_bps is None:
            return RAW
        return cand if compression_wins(t.write_bps, cs.encode_bps, cs.ratio) else RAW

    def _ratio(self, v: VersionView, t: TierStats, ctx: PolicyContext) -> float:
        codec = self._codec(v, t, ctx)
        cs = ctx.codecs.get(codec)
        if codec == RAW or cs is None or cs.ratio is None:
            return 1.0
        return max(cs.ratio, 1.0)

    # ------------------------------------------------------------------ eviction and a full arena

    def _eviction_order(self, tier: str, ctx: PolicyContext) -> list[VersionView]:
        on_tier = [v for v in ctx.versions if tier in v.tiers and tier not in v.pending]
        kept = self.retention.keep(on_tier)
        unpinned = [v for v in on_tier if not v.pinned]
        # Without a user-set retention, only copies another durable tier holds go (the keep rule).
        expendable = [v for v in unpinned if v.id not in kept and (self.retention_rule or _elsewhere(v, tier, ctx))]
        spare = [v for v in unpinned if v.id in kept and _elsewhere(v, tier, ctx)]
        return expendable + spare

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        """Versions to drop from ``tier`` so that the next pending version fits, oldest first.

        With a user-set retention, first the oldest versions it does not keep; then the oldest
        ones another durable tier also holds; never a branch head or a tag.
        """
        stats = ctx.tiers.get(tier)
        if stats is None or stats.capacity is None:
            return []
        by_id = {v.id: v for v in ctx.versions}
        queue = [by_id[i] for i in ctx.pending.get(tier, ()) if i in by_id]
        incoming = queue[0].nbytes if queue else 0
        need = stats.used_bytes + incoming - stats.capacity
        out: list[str] = []
        for v in self._eviction_order(tier, ctx):
            if need <= 0:
                break
            out.append(v.id)
            need -= v.nbytes
        return out

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        """What ``save()`` does when the arena is full (``on_full``; ``wait`` by default).

        Coalescing already frees the arena of versions no tier will write, so what is left
        there is being written and waiting is short.
        """
        return self._on_full


# ---------------------------------------------------------------------- finding a policy


def _preset_dirs() -> list[Path]:
    dirs = [Path(__file__).resolve().parents[2] / "policies"]  # a source checkout
    with contextlib.suppress(ModuleNotFoundError, TypeError):
        dirs.append(Path(str(resources.files("tiercache") / "_presets")))  # an installed wheel
    return dirs


def preset_names() -> list[str]:
    """Names of the presets found in ``policies/`` (or the wheel's copy of it)."""
    names: set[str] = set()
    for d in _preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def _preset_path(name: str) -> Path | None:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    for d in _preset_dirs():
        path = d / f"{name}.toml"
        if path.is_file():
            return path
    return None


def load_preset(path: Path) -> PolicyConfig:
    """Read a preset file: a ``[policy]`` table with ``name`` and ``params``.

    Raises:
        ConfigError: If the file is not valid TOML or a field is invalid (names file and field).
    """
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"policy preset {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"policy preset {path} cannot be read: {e.strerror}") from None
    if set(data) != {"policy"}:
        extra = sorted(set(data) - {"policy"})
        field = extra[0] if extra else "policy"
        raise ConfigError(f"policy preset {path}: field '{field}': a preset holds exactly one [policy] table")
    try:
        return PolicyConfig.model_validate(data["policy"])
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(["policy", *(str(p) for p in err["loc"])])
        raise ConfigError(f"policy preset {path}: field '{field}': {err['msg']}") from None


def _from_entry_points(name: str) -> Callable[..., Policy] | None:
    for ep in metadata.entry_points(group="tiercache.policies"):
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    return None


def _from_path(spec: str) -> Callable[..., Policy]:
    """The class ``package.module:Class`` names, once it is known to be a policy class (nothing called yet)."""
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"policy {spec!r} cannot be imported: {e}") from None
    # Checked before it is called: a name such as os:system must never run.
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise ConfigError(f"policy {spec!r} is not a policy class (a class with place(), evict() and "
                          "on_full(): implement tiercache.Policy)")
    return obj


def _check_params(name: str, factory: Callable[..., Policy], params: Mapping[str, Any]) -> None:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin or C callable: let the call itself complain
    ps = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps):
        return
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    accepted = [p.name for p in ps if p.kind in named]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"policy {name!r}: field 'params.{unknown[0]}': unknown parameter; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )


def _resolve(name: str) -> Callable[..., Policy]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _from_path(name)
    factory = _from_entry_points(name)
    if factory is None:
        raise ConfigError(
            f"unknown policy {name!r}: use one of {', '.join(registered_names())}, a preset "
            f"({', '.join(preset_names()) or 'none found'}), or package.module:Class"
        )
    return factory


def _instantiate(name: str, params: Mapping[str, Any]) -> Policy:
    factory = _resolve(name)
    _check_params(name, factory, params)
    try:
        policy = factory(**params)
    except TypeError as e:
        raise ConfigError(f"policy {name!r}: bad parameters {sorted(params)}: {e}") from None
    for method in ("place", "evict", "on_full"):
        if not callable(getattr(policy, method, None)):
            raise ConfigError(f"policy {name!r} has no {method}() method: implement tiercache.Policy")
    return policy


def load_policy(cfg: PolicyConfig) -> Policy:
    """Instantiate the policy a config names.

    A name is looked up as a preset ``policies/<name>.toml`` first (whose ``[policy]`` table
    names a registered policy, a ``package.module:Class`` or an entry point, with parameters
    that ``cfg.params`` overrides one by one), then as a registered name, a
    ``package.module:Class`` path, and an entry point of the group ``tiercache.policies``.

    Raises:
        ConfigError: If the name is unknown, a preset is malformed, or the parameters are not
            accepted by the policy (the message names the file, the policy and the field).
    """
    path = _preset_path(cfg.name)
    if path is None:
        return _instantiate(cfg.name, cfg.params)
    preset = load_preset(path)
    try:
        policy = _instantiate(preset.name, preset.params)
    except ConfigError as e:
        raise ConfigError(f"policy preset {path}: {e}") from None
    # The preset alone is valid, so an error from here on is in the caller's own params.
    return _instantiate(preset.name, {**preset.params, **cfg.params}) if cfg.params else policy
