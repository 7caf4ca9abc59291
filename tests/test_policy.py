"""Policies as pure functions: synthetic contexts in, exact decisions out.

Nothing here starts an engine or touches a tier: every case builds a :class:`PolicyContext` by
hand (tier speeds, pending versions, codec numbers) and checks the decision the policy returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tiercache.policy.builtin as builtin
from tiercache.config import CacheConfig, PolicyConfig
from tiercache.errors import ConfigError
from tiercache.policy.base import CodecView, Placement, PolicyContext, TierPlan, TierStats, VersionView
from tiercache.policy.builtin import (
    ThroughputAdaptive,
    WriteThrough,
    compression_wins,
    load_policy,
    preset_names,
    registered_names,
)
from tiercache.policy.retention import (
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    KeepPinned,
    retention_from_params,
)

MB = 1_000_000
T0 = 1000.0


def tier(name: str, *, bps: float | None = None, cap: int | None = None, used: int = 0, remote: bool = False,
         durable: bool = True, latency: float | None = None, down: str = "", queue: int = 0,
         backlog: int = 0) -> TierStats:
    return TierStats(name, durable, cap, used, write_bps=bps, remote=remote, write_latency_s=latency,
                     available=not down, unavailable=down, queue_depth=queue, backlog_bytes=backlog)


def disk(bps: float | None = 1000 * MB, **kw: Any) -> TierStats:
    return tier("disk", bps=bps, **kw)


def s3(bps: float | None = 100 * MB, **kw: Any) -> TierStats:
    return tier("s3", bps=bps, remote=True, **kw)


def ver(i: int, *, at: float | None = None, nbytes: int = 8 * MB, tiers: Iterable[str] = (),
        pending: Iterable[str] = (), pinned: bool = False, step: int | None = None,
        meta: Mapping[str, Any] | None = None, floats: float = 1.0, branch: str = "main") -> VersionView:
    return VersionView(
        id=f"V{i:03d}", branch=branch, step=i * 10 if step is None else step, nbytes=nbytes,
        created_at=T0 + i if at is None else at, tiers=frozenset(tiers), pending=frozenset(pending),
        pinned=pinned, meta=dict(meta or {}), float_fraction=floats,
    )


def ctx(tiers: Iterable[TierStats], versions: Iterable[VersionView] = (), *, now: float | None = None,
        codecs: Mapping[str, CodecView] | None = None) -> PolicyContext:
    vs = tuple(sorted(versions, key=lambda v: v.id))
    ts = {t.name: t for t in tiers}
    pending = {n: tuple(v.id for v in vs if n in v.pending) for n in ts}
    return PolicyContext(
        now=max((v.created_at for v in vs), default=T0) if now is None else now,
        tiers=ts, codecs=dict(codecs or {}), versions=vs, pending=pending,
    )


def codec(name: str = "bgzstd/1", enc: float = 200 * MB, ratio: float = 2.0) -> dict[str, CodecView]:
    return {name: CodecView(name, enc, None, ratio)}


def plans(p: Placement) -> dict[str, tuple[str, bool]]:
    return {x.tier: (x.codec, x.skip) for x in p.plans}


RAW, BG, Z = "raw/1", "bgzstd/1", "zstd/1"


# ---------------------------------------------------------------------- registry and presets


def test_builtins_are_registered_and_adaptive_is_the_default() -> None:
    assert registered_names() == ["throughput-adaptive", "write-through"]
    assert PolicyConfig().name == "throughput-adaptive"
    assert isinstance(load_policy(CacheConfig().policy), ThroughputAdaptive)
    assert isinstance(load_policy(PolicyConfig(name="write-through")), WriteThrough)


def test_shipped_presets_load_with_their_parameters() -> None:
    assert {"write-through", "throughput-adaptive", "slow-s3", "keep-best"} <= set(preset_names())
    slow = load_policy(PolicyConfig(name="slow-s3"))
    assert isinstance(slow, ThroughputAdaptive)
    assert (slow.max_remote_lag_s, slow.headroom, slow.codec) == (120.0, 0.7, BG)
    assert repr(slow.retention) == "KeepAny(KeepPinned(), KeepLatest(5), KeepEveryNSteps(1000))"
    best = load_policy(PolicyConfig(name="keep-best"))
    assert repr(best.retention) == "KeepAny(KeepPinned(), KeepLatest(2), KeepBest('eval_loss', n=3, mode='min'))"
    wt = load_policy(PolicyConfig(name="write-through"))
    assert isinstance(wt, WriteThrough) and wt.keep == 3


def test_config_params_override_a_preset_one_by_one() -> None:
    p = load_policy(PolicyConfig(name="slow-s3", params={"headroom": 0.5}))
    assert (p.headroom, p.max_remote_lag_s) == (0.5, 120.0)


@pytest.fixture
def preset_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(builtin, "_preset_dirs", lambda: [tmp_path])
    return tmp_path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[policy\nname = 1", "is not valid TOML"),
        ('[policy]\nname = "throughput-adaptive"\n[budgets]\nram = 1\n', "field 'budgets'"),
        ('[policy]\nname = "throughput-adaptive"\nparms = {}\n', "field 'policy.parms'"),
        ('[policy]\nname = "throughput-adaptive"\nparams = { headroom = 2 }\n', "field 'params.headroom'"),
        ('[policy]\nname = "throughput-adaptive"\nparams = { headrom = 0.5 }\n', "field 'params.headrom'"),
        ('[policy]\nname = "throughput-adaptive"\nparams = { retention = { latest = 0 } }\n',
         "field 'params.retention.latest'"),
        ('[policy]\nname = "no-such-policy"\n', "unknown policy 'no-such-policy'"),
        ('[policy]\nname = "bad"\n', "unknown policy 'bad'"),
    ],
)
def test_a_malformed_preset_is_an_error_naming_file_and_field(preset_dir: Path, body: str, expected: str) -> None:
    path = preset_dir / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_policy(PolicyConfig(name="bad"))
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_an_unknown_name_lists_what_exists() -> None:
    with pytest.raises(ConfigError) as err:
        load_policy(PolicyConfig(name="fastest"))
    msg = str(err.value)
    assert msg.startswith("unknown policy 'fastest': use one of throughput-adaptive, write-through, a preset (")
    assert "slow-s3" in msg and "package.module:Class" in msg


def test_unknown_and_invalid_parameters_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"field 'params\.keep_last': unknown parameter; accepted: keep, on_full"):
        load_policy(PolicyConfig(name="write-through", params={"keep_last": 2}))
    with pytest.raises(ConfigError, match=r"field 'params\.keep': expected an int >= 1, got 0"):
        load_policy(PolicyConfig(name="write-through", params={"keep": 0}))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"max_remote_lag_s": 0}, "max_remote_lag_s"),
        ({"max_remote_lag_s": True}, "max_remote_lag_s"),
        ({"headroom": 1.5}, "headroom"),
        ({"compression": "yes"}, "compression"),
        ({"codec": "raw/1"}, "codec"),
        ({"codec": "lz4/1"}, "codec"),
        ({"direct_to_remote": 1}, "direct_to_remote"),
        ({"ingest_window": 1}, "ingest_window"),
        ({"on_full": "drop"}, "on_full"),
        ({"retention": {"best": {"metric": "loss", "mode": "lowest"}}}, "retention.best.mode"),
        ({"retention": {"best": {"n": 2}}}, "retention.best.metric"),
        ({"retention": {"newest": 2}}, "retention.newest"),
    ]
    for params, field in bad:
        with pytest.raises(ConfigError, match=rf"^throughput-adaptive: field 'params\.{field}'"):
            load_policy(PolicyConfig(name="throughput-adaptive", params=params))


class NoOpPolicy:
    """A custom policy for the loader tests: keeps everything in RAM only."""

    def __init__(self, label: str = "x") -> None:
        self.label = label

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        return Placement(())

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        return []

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> str:
        return "skip"


class NotAPolicy:
    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        return Placement(())


def test_a_custom_class_by_module_path() -> None:
    p = load_policy(PolicyConfig(name=f"{__name__}:NoOpPolicy", params={"label": "mine"}))
    assert isinstance(p, NoOpPolicy) and p.label == "mine"
    # Checked to be a policy class before it is called (its __init__ never runs).
    with pytest.raises(ConfigError, match=rf"^policy '{__name__}:NotAPolicy' is not a policy class \(a class with "
                       r"place\(\), evict\(\) and on_full\(\): implement tiercache.Policy\)$"):
        load_policy(PolicyConfig(name=f"{__name__}:NotAPolicy"))
    with pytest.raises(ConfigError, match=r"^policy 'tiercache\.nope:X' cannot be imported"):
        load_policy(PolicyConfig(name="tiercache.nope:X"))


def test_a_custom_class_by_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = metadata.EntryPoint(name="my-policy", value=f"{__name__}:NoOpPolicy", group="tiercache.policies")
    seen: list[str] = []

    def entry_points(*, group: str) -> list[metadata.EntryPoint]:
        seen.append(group)
        return [ep] if group == "tiercache.policies" else []

    monkeypatch.setattr(builtin.metadata, "entry_points", entry_points)
    p = load_policy(PolicyConfig(name="my-policy"))
    assert isinstance(p, NoOpPolicy)
    assert seen == ["tiercache.policies"]


# ---------------------------------------------------------------------- retention helpers


def test_keep_latest_every_steps_best_and_pinned() -> None:
    vs = [
        ver(1, step=1000, meta={"loss": 0.9}),
        ver(2, step=1500, meta={"loss": 0.4}),
        ver(3, step=2000, meta={"loss": 0.4}),
        ver(4, step=2500, meta={"loss": "n/a"}),
        ver(5, step=3000, meta={}, pinned=True),
        ver(6, step=3500, meta={"loss": 0.7, "acc": 0.8}),
    ]
    assert KeepLatest(2).keep(vs) == {"V005", "V006"}
    assert KeepEveryNSteps(1000).keep(vs) == {"V001", "V003", "V005"}
    assert KeepBest("loss", n=1).keep(vs) == {"V003"}  # a tie: the newer wins
    assert KeepBest("loss", n=2).keep(vs) == {"V002", "V003"}
    assert KeepBest("loss", n=2, mode="max").keep(vs) == {"V001", "V006"}
    assert KeepBest("acc", n=5, mode="max").keep(vs) == {"V006"}
    assert KeepPinned().keep(vs) == {"V005"}
    assert KeepAny(KeepLatest(1), KeepBest("loss")).keep(vs) == {"V003", "V006"}
    assert KeepLatest(3).keep([]) == set()


def test_retention_from_params() -> None:
    r = retention_from_params({"latest": 1, "every_steps": 2000, "best": {"metric": "loss", "n": 1}})
    assert repr(r) == "KeepAny(KeepPinned(), KeepLatest(1), KeepEveryNSteps(2000), KeepBest('loss', n=1, mode='min'))"
    assert repr(retention_from_params(None)) == "KeepAny(KeepPinned())"
    with pytest.raises(ConfigError, match=r"^field 'retention\.best\.k': unknown key"):
        retention_from_params({"best": {"metric": "loss", "k": 1}})
    with pytest.raises(ConfigError, match=r"^field 'retention\.best': expected a table"):
        retention_from_params({"best": "loss"})
    with pytest.raises(ConfigError, match=r"^field 'retention': expected a table"):
        retention_from_params(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^field 'retention\.every_steps': expected an int >= 1, got True"):
        retention_from_params({"every_steps": True})


# ---------------------------------------------------------------------- write-through


def test_write_through_places_everything_raw_and_keeps_newest_n() -> None:
    p = WriteThrough(keep=2)
    c = ctx([tier("ram", durable=False), disk(), s3()],
            [ver(1, tiers={"disk"}), ver(2, tiers={"disk"}, pinned=True), ver(3, tiers={"disk"}),
             ver(4, tiers={"disk", "s3"})])
    assert p.place(ver(5), c) == Placement((TierPlan("disk"), TierPlan("s3")))
    assert p.evict("disk", c) == ["V001"]  # V002 is beyond the newest 2 but pinned
    assert p.evict("s3", c) == []
    # A keep the user did not set prunes nothing: only copies another durable tier holds go.
    assert WriteThrough().evict("disk", c) == [] and WriteThrough().retention_rule is None
    assert p.retention_rule == "write-through keep = 2"
    assert p.on_full(1, c) == "wait"
    assert WriteThrough(on_full="skip").on_full(1, c) == "skip"


# ---------------------------------------------------------------------- throughput-adaptive: coalescing


def slow_s3_ctx(*, s3_bps: float | None, pinned_mid: bool = False, now: float = T0 + 3) -> PolicyContext:
    """Saves of 8 MB every second; V000 on both tiers; V001..V003 pending for S3 (V001 in flight)."""
    vs = [ver(0, tiers={"ram", "disk", "s3"})]
    vs += [ver(i, tiers={"ram", "disk"}, pending={"s3"}, pinned=pinned_mid and i == 2) for i in (1, 2, 3)]
    # Incompressible data, so every plan is raw and only the skip decisions differ.
    return ctx([tier("ram", durable=False), disk(), s3(s3_bps)], vs, now=now, codecs=codec(BG, 200 * MB, 1.0))


def test_ingest_rate_is_bytes_of_recent_saves_over_their_span_up_to_now() -> None:
    p = ThroughputAdaptive()
    c = slow_s3_ctx(s3_bps=2 * MB)
    assert p.ingest_bps(c) == 24 * MB / 3  # V001..V003 over [V000, now]
    assert p.ingest_bps(slow_s3_ctx(s3_bps=2 * MB, now=T0 + 6)) == 24 * MB / 6
    assert ThroughputAdaptive(ingest_window=2).ingest_bps(c) == 8 * MB / 1
    assert p.ingest_bps(ctx([s3()], [ver(1)])) is None


def test_when_s3_cannot_keep_up_only_the_newest_pending_version_is_uploaded() -> None:
    p = ThroughputAdaptive()
    c = slow_s3_ctx(s3_bps=2 * MB)
    mid = p.place(ver(2, tiers={"ram", "disk"}, pending={"s3"}), c)
    assert plans(mid) == {"disk": (RAW, False), "s3": (RAW, True)}
    assert mid.plan_for("s3").reason == (
        "coalesced: saves arrive at 8.0 MB/s, s3 absorbs 2.0 MB/s; newer version V003 is pending"
    )
    # The oldest pending one is the one in flight: it has newer ones too, and is skipped if asked.
    assert p.place(ver(1, tiers={"ram", "disk"}, pending={"s3"}), c).plan_for("s3").skip
    newest = p.place(ver(3, tiers={"ram", "disk"}, pending={"s3"}), c)
    assert newest.plan_for("s3") == TierPlan("s3", RAW)
    # Skipping is for S3 only: the disk keeps up and gets every version.
    assert not mid.plan_for("disk").skip


def test_until_s3_is_measured_intermediate_versions_are_skipped() -> None:
    p = ThroughputAdaptive()
    c = slow_s3_ctx(s3_bps=None)
    plan = p.place(ver(2, tiers={"ram", "disk"}, pending={"s3"}), c).plan_for("s3")
    assert plan.skip and plan.reason == "coalesced: s3 speed not measured yet and newer version V003 is pending"


def test_when_s3_keeps_up_every_version_is_uploaded() -> None:
    p = ThroughputAdaptive()
    c = slow_s3_ctx(s3_bps=20 * MB)  # 8 MB/s of saves <= 0.9 * 20 MB/s
    for i in (1, 2, 3):
        assert p.place(ver(i, tiers={"ram", "disk"}, pending={"s3"}), c).plan_for("s3") == TierPlan("s3", RAW)
    # Just past the headroom it coalesces.
    c = slow_s3_ctx(s3_bps=8.8 * MB)
    assert p.place(ver(2, tiers={"ram", "disk"}, pending={"s3"}), c).plan_for("s3").skip
    assert not ThroughputAdaptive(headroom=1.0).place(ver(2, pending={"s3"}), c).plan_for("s3").skip


def test_a_pinned_version_is_never_coalesced_away() -> None:
    p = ThroughputAdaptive()
    c = slow_s3_ctx(s3_bps=2 * MB, pinned_mid=True)
    v2 = ver(2, tiers={"ram", "disk"}, pending={"s3"}, pinned=True)
    assert p.place(v2, c).plan_for("s3") == TierPlan("s3", RAW)


def lag_ctx() -> PolicyContext:
    """Saves of 8 MB every 10 s; S3 at 2 MB/s keeps up on rate; V000 is on S3, V001..V003 pending."""
    vs = [ver(0, at=T0, tiers={"disk", "s3"})]
    vs += [ver(i, at=T0 + 10 * i, tiers={"disk"}, pending={"s3"}) for i in (1, 2, 3)]
    return ctx([disk(), s3(2 * MB)], vs, now=T0 + 30, codecs=codec(BG, 200 * MB, 1.0))


def test_projected_lag_of_writing_every_pending_version_in_order() -> None:
    p = ThroughputAdaptive()
    c = lag_ctx()
    assert p.ingest_bps(c) == 24 * MB / 30
    # V001 lands at +34 (34 s after V000 was saved), V002 at +38 (28 s after V001), V003 at +42.
    assert p.projected_lag(c.tiers["s3"], c, lambda x: x.nbytes / (2 * MB)) == 34.0


def test_the_remote_lag_bound_turns_on_coalescing_even_when_the_rate_fits() -> None:
    v2 = ver(2, at=T0 + 20, tiers={"disk"}, pending={"s3"})
    assert not ThroughputAdaptive(max_remote_lag_s=60).place(v2, lag_ctx()).plan_for("s3").skip
    plan = ThroughputAdaptive(max_remote_lag_s=30).place(v2, lag_ctx()).plan_for("s3")
    assert plan.skip
    assert plan.reason == (
        "coalesced: writing every pending version would leave s3 34s behind (bound 30s); newer version V003 is pending"
    )


# ---------------------------------------------------------------------- throughput-adaptive: RAM -> S3 directly


def test_a_disk_slower_than_s3_is_bypassed_and_probed_now_and_then() -> None:
    p = ThroughputAdaptive(disk_probe_s=60, compression="off")
    # Saves of 8 MB every 0.1 s (80 MB/s): the disk (50 MB/s) does not keep up, S3 (100 MB/s) does.
    recent = ctx([disk(50 * MB), s3(100 * MB)], [ver(1, tiers={"disk", "s3"}, at=T0 + 9.9), ver(2, at=T0 + 10)],
                 now=T0 + 10)
    got = p.place(ver(2), recent)
    assert plans(got) == {"s3": (RAW, False), "disk": (RAW, True)}
    assert [x.tier for x in got.plans] == ["s3", "disk"]  # fastest first
    assert got.plan_for("disk").reason == (
        "disk slower than s3 for this version (50.0 < 100.0 MB/s, queues and per-request latency included): "
        "RAM -> s3 directly"
    )
    stale = ctx([disk(50 * MB), s3(100 * MB)], [ver(0, at=T0 + 99.8, tiers={"s3"}), ver(1, tiers={"disk", "s3"}),
                                                 ver(2, at=T0 + 100)], now=T0 + 100)
    assert plans(p.place(ver(2, at=T0 + 100), stale)) == {"s3": (RAW, False), "disk": (RAW, False)}
    # A disk that keeps up with the saves is never bypassed, however fast S3 is.
    calm = ctx([disk(50 * MB), s3(100 * MB)], [ver(1, tiers={"disk", "s3"}), ver(2, at=T0 + 10)], now=T0 + 10)
    assert not p.place(ver(2, at=T0 + 10), calm).plan_for("disk").skip
    assert not ThroughputAdaptive(direct_to_remote=False).place(ver(2, at=T0 + 10), recent).plan_for("disk").skip


def test_a_full_disk_is_bypassed_unless_eviction_makes_room() -> None:
    p = ThroughputAdaptive()
    vs = [ver(1, tiers={"disk", "s3"}, pinned=True), ver(2)]
    full = ctx([disk(cap=20 * MB, used=16 * MB), s3()], vs)
    plan = p.place(ver(2), full).plan_for("disk")
    assert plan.skip and plan.reason == (
        "disk full (16000000 of 20000000 bytes used, 0 evictable; eviction keeps branch heads, tags and versions "
        "no other durable tier holds): RAM -> s3 directly"
    )
    vs = [ver(0, tiers={"disk", "s3"}), ver(1, tiers={"disk", "s3"}, pinned=True), ver(2)]
    roomy = ctx([disk(cap=20 * MB, used=16 * MB), s3()], vs)
    assert not p.place(ver(2), roomy).plan_for("disk").skip
    # A version only the disk holds is no room: the keep rule keeps it (without a retention the user set).
    vs = [ver(0, tiers={"disk"}), ver(1, tiers={"disk", "s3"}, pinned=True), ver(2)]
    sole = ctx([disk(cap=20 * MB, used=16 * MB), s3()], vs)
    assert p.place(ver(2), sole).plan_for("disk").skip
    assert not ThroughputAdaptive(retention={"latest": 1}).place(ver(2), sole).plan_for("disk").skip


def test_without_a_remote_tier_the_disk_is_never_bypassed() -> None:
    p = ThroughputAdaptive()
    c = ctx([disk(50 * MB, cap=1 * MB, used=1 * MB)], [ver(1)])
    assert p.place(ver(1), c) == Placement((TierPlan("disk", RAW),))  # nothing measured: raw


# ---------------------------------------------------------------------- throughput-adaptive: codecs


def test_compression_wins_arithmetic() -> None:
    assert compression_wins(tier_bps=2 * MB, encode_bps=200 * MB, ratio=1.5)
    assert not compression_wins(tier_bps=1000 * MB, encode_bps=200 * MB, ratio=2.0)
    assert not compression_wins(tier_bps=2 * MB, encode_bps=200 * MB, ratio=1.0)
    assert not compression_wins(tier_bps=100 * MB, encode_bps=150 * MB, ratio=3.0)  # 1/150 + 1/300 > 1/100


def test_compression_is_on_for_a_slow_s3_link_and_off_for_a_fast_disk() -> None:
    p = ThroughputAdaptive()
    c = ctx([disk(1000 * MB), s3(4 * MB)], [ver(1)], codecs=codec(BG, 200 * MB, 2.0))
    assert plans(p.place(ver(1), c)) == {"disk": (RAW, False), "s3": (BG, False)}
    fast = ctx([disk(1000 * MB), s3(1000 * MB)], [ver(1)], codecs=codec(BG, 200 * MB, 2.0))
    assert plans(p.place(ver(1), fast)) == {"disk": (RAW, False), "s3": (RAW, False)}
    incompressible = ctx([disk(1000 * MB), s3(4 * MB)], [ver(1)], codecs=codec(BG, 200 * MB, 1.0))
    assert plans(p.place(ver(1), incompressible)) == {"disk": (RAW, False), "s3": (RAW, False)}


def test_until_the_codec_and_the_tier_are_measured_versions_go_raw() -> None:
    # No version is compressed blind (the engine measures the codec on a sample: test_probe.py).
    p = ThroughputAdaptive()
    c = ctx([disk(None), s3(None)], [ver(1)])
    assert plans(p.place(ver(1), c)) == {"disk": (RAW, False), "s3": (RAW, False)}
    assert plans(p.place(ver(1, floats=0.2), c)) == {"disk": (RAW, False), "s3": (RAW, False)}
    slow_tier_codec_unknown = ctx([disk(1000 * MB), s3(4 * MB)], [ver(1)])
    assert plans(p.place(ver(1), slow_tier_codec_unknown)) == {"disk": (RAW, False), "s3": (RAW, False)}
    measured_codec_unknown_tier = ctx([disk(None), s3(None)], [ver(1)], codecs=codec())
    assert plans(p.place(ver(1), measured_codec_unknown_tier)) == {"disk": (RAW, False), "s3": (RAW, False)}


def test_compression_switches_and_candidate_codec() -> None:
    c = ctx([disk(1000 * MB), s3(4 * MB)], [ver(1)], codecs=codec(Z, 300 * MB, 1.5))
    assert plans(ThroughputAdaptive(compression="off").place(ver(1), c)) == {"disk": (RAW, False), "s3": (RAW, False)}
    assert plans(ThroughputAdaptive(compression="on").place(ver(1), c)) == {"disk": (BG, False), "s3": (BG, False)}
    assert plans(ThroughputAdaptive(codec=Z).place(ver(1), c)) == {"disk": (RAW, False), "s3": (Z, False)}


def test_the_compression_ratio_counts_when_judging_whether_s3_keeps_up() -> None:
    # 8 MB/s of saves, S3 moves 5 MB/s of stored bytes: raw it cannot keep up, at 2:1 it can.
    vs = [ver(0, tiers={"disk", "s3"})] + [ver(i, tiers={"disk"}, pending={"s3"}) for i in (1, 2, 3)]
    raw = ctx([disk(), s3(5 * MB)], vs, now=T0 + 3)
    assert ThroughputAdaptive(compression="off").place(vs[2], raw).plan_for("s3").skip
    packed = ctx([disk(), s3(5 * MB)], vs, now=T0 + 3, codecs=codec(BG, 400 * MB, 2.0))
    assert ThroughputAdaptive().place(vs[2], packed).plan_for("s3") == TierPlan("s3", BG)


# ---------------------------------------------------------------------- throughput-adaptive: eviction


def test_evicts_oldest_unpinned_first_only_as_much_as_the_next_version_needs() -> None:
    p = ThroughputAdaptive()
    vs = [
        ver(1, tiers={"disk"}, pinned=True),  # a tag
        ver(2, tiers={"disk"}),
        ver(3, tiers={"disk", "s3"}),
        ver(4, tiers={"disk"}),
        ver(5, pending={"disk"}),
    ]
    # Without a retention the user set, only versions another durable tier holds go (the keep rule).
    c = ctx([disk(cap=40 * MB, used=36 * MB), s3()], vs)
    assert p.evict("disk", c) == ["V003"]
    c = ctx([disk(cap=40 * MB, used=41 * MB), s3()], vs)
    assert p.evict("disk", c) == ["V003"]
    # With one, the oldest versions it does not keep go first, even a last copy (pruned).
    q = ThroughputAdaptive(retention={"latest": 1})
    c = ctx([disk(cap=40 * MB, used=36 * MB), s3()], vs)
    assert q.evict("disk", c) == ["V002"]  # 36 + 8 > 40: one version's worth
    c = ctx([disk(cap=40 * MB, used=41 * MB), s3()], vs)
    assert q.evict("disk", c) == ["V002", "V003"]
    c = ctx([disk(cap=80 * MB, used=32 * MB), s3()], vs)
    assert p.evict("disk", c) == q.evict("disk", c) == []
    assert p.evict("s3", c) == []  # no budget: never under pressure


def test_retained_versions_go_only_if_another_durable_tier_holds_them() -> None:
    p = ThroughputAdaptive(retention={"best": {"metric": "loss", "n": 2}})
    vs = [
        ver(1, tiers={"disk"}, meta={"loss": 0.1}),
        ver(2, tiers={"disk", "s3"}, meta={"loss": 0.2}),
        ver(3, tiers={"disk"}, meta={"loss": 0.9}),
        ver(4, tiers={"disk"}, pinned=True),
        ver(5, pending={"disk"}),
    ]
    c = ctx([disk(cap=32 * MB, used=40 * MB), s3()], vs)
    assert p.evict("disk", c) == ["V003", "V002"]  # V001 is kept by retention and exists nowhere else
    assert not p.place(ver(5), c).plan_for("disk").skip  # 32 - 40 + 16 evictable leaves 8 MB: it fits
    assert p.place(ver(5, nbytes=9 * MB), c).plan_for("disk").skip  # it does not: RAM -> S3 directly


def test_on_full_is_the_configured_answer() -> None:
    c = ctx([disk()], [])
    assert ThroughputAdaptive().on_full(1, c) == "wait"
    assert ThroughputAdaptive(on_full="skip").on_full(1, c) == "skip"


# ---------------------------------------------------------------------- properties


@st.composite
def contexts(draw: st.DrawFn) -> PolicyContext:
    n = draw(st.integers(1, 8))
    vs = []
    for i in range(n):
        tiers = draw(st.sets(st.sampled_from(["disk", "s3"])))
        pending = draw(st.sets(st.sampled_from(["disk", "s3"]))) - tiers
        vs.append(ver(i, at=T0 + draw(st.floats(0, 100)), nbytes=draw(st.integers(1, 64)) * MB,
                      tiers=tiers, pending=pending, pinned=draw(st.booleans())))
    bps = st.one_of(st.none(), st.floats(0.1, 2000).map(lambda x: x * MB))
    cap = st.one_of(st.none(), st.integers(1, 512).map(lambda x: x * MB))
    tiers = [
        disk(draw(bps), cap=draw(cap), used=draw(st.integers(0, 512)) * MB),
        s3(draw(bps), cap=draw(cap), used=draw(st.integers(0, 512)) * MB),
    ]
    codecs = draw(st.one_of(st.just({}), st.floats(1.0, 4.0).map(lambda r: codec(BG, 200 * MB, r))))
    return ctx(tiers, vs, now=T0 + 100, codecs=codecs)


@settings(max_examples=200, deadline=None)
@given(contexts(), st.floats(1, 600))
def test_pinned_versions_are_never_evicted_nor_coalesced_away(c: PolicyContext, bound: float) -> None:
    p = ThroughputAdaptive(max_remote_lag_s=bound, retention={"latest": 1})
    pinned = {v.id for v in c.versions if v.pinned}
    for name in ("disk", "s3"):
        out = p.evict(name, c)
        assert not set(out) & pinned
        assert len(out) == len(set(out))
        assert all(name in v.tiers for v in c.versions if v.id in out)
    for v in c.versions:
        placement = p.place(v, c)
        assert {x.tier for x in placement.plans} == {"disk", "s3"}
        newest = all(i <= v.id for i in c.pending["s3"])
        if v.pinned or newest:
            assert not placement.plan_for("s3").skip


# ---------------------------------------------------------------------- every version reaches a durable tier


def test_latency_plus_bandwidth_ranks_tiers_by_the_time_for_this_versions_bytes() -> None:
    # A disk whose fsyncs cost 10 ms per request but that writes 2 GB/s, and an S3 of 1 ms and 100 MB/s.
    p = ThroughputAdaptive(compression="off")
    fsyncing, s3_link = disk(2000 * MB, latency=0.010), s3(100 * MB, latency=0.001)
    small, large = ver(2, nbytes=1 * MB), ver(2, nbytes=512 * MB)
    c = ctx([fsyncing, s3_link], [ver(1, tiers={"disk", "s3"}), small])
    # 1 MB: the disk needs 30.5 ms, S3 13 ms; 512 MB: the disk 0.29 s, S3 5.1 s.
    assert p.eta(small, fsyncing, c) == pytest.approx(0.030 + 1 / 2000)
    assert p.eta(small, s3_link, c) == pytest.approx(0.003 + 1 / 100)
    assert [x.tier for x in p.place(small, c).plans] == ["s3", "disk"]
    assert not p.place(small, c).plan_for("disk").skip  # a version a second: the disk keeps up
    busy = ctx([fsyncing, s3_link],
               [ver(1, nbytes=1 * MB, at=T0 + 1.99, tiers={"disk"}), ver(2, nbytes=1 * MB, at=T0 + 2)])
    assert p.place(ver(2, nbytes=1 * MB, at=T0 + 2), busy).plan_for("disk").skip  # 100 a second: it does not
    assert [x.tier for x in p.place(large, c).plans] == ["disk", "s3"]
    assert not p.place(large, c).plan_for("disk").skip


def test_a_queue_counts_in_the_time_a_tier_needs() -> None:
    p = ThroughputAdaptive(compression="off")
    busy_s3 = s3(100 * MB, latency=0.001, queue=3, backlog=300 * MB)  # 3 s of work queued
    c = ctx([disk(50 * MB), busy_s3], [ver(1, tiers={"disk", "s3"}), ver(2)])
    assert p.eta(ver(2), busy_s3, c) == pytest.approx(3 + 4 * 0.003 + 8 / 100)
    assert not p.place(ver(2), c).plan_for("disk").skip  # the disk (0.16 s) beats S3's queue


def test_s3_never_coalesces_a_version_that_bypasses_the_disk() -> None:
    # The disk is slower for small versions, so it is bypassed; S3 cannot keep up with every save,
    # but it is then the only tier that takes the version: it must not coalesce it away.
    p = ThroughputAdaptive(compression="off")
    vs = [ver(0, tiers={"disk", "s3"}), *[ver(i, nbytes=1 * MB, pending={"s3"}) for i in (1, 2, 3)]]
    c = ctx([disk(2000 * MB, latency=1.0), s3(MB // 2)], vs)  # 1 MB: the disk 3 s, S3 2 s
    got = p.place(vs[2], c)
    assert got.plan_for("disk").skip and "slower than s3" in got.plan_for("disk").reason
    assert not got.plan_for("s3").skip
    # Once the disk holds it, S3 may coalesce it again.
    held = p.place(ver(2, nbytes=1 * MB, tiers={"disk"}, pending={"s3"}), c).plan_for("s3")
    assert held.skip and held.reason.startswith("coalesced:")


def test_an_unavailable_tier_is_skipped_with_its_reason_and_the_other_takes_every_version() -> None:
    p = ThroughputAdaptive(compression="off")
    vs = [ver(0, tiers={"disk", "s3"}), *[ver(i, nbytes=1 * MB, pending={"disk"}) for i in (1, 2, 3)]]
    c = ctx([disk(1 * MB), s3(100 * MB, down="TierUnavailableError: connection refused")], vs)
    got = p.place(vs[1], c)
    assert got.plan_for("s3") == TierPlan("s3", RAW, skip=True,
                                          reason="s3 unavailable (TierUnavailableError: connection refused)")
    assert got.plan_for("disk") == TierPlan("disk", RAW)  # slow and behind, but the only tier left
    both_down = ctx([disk(down="EIO"), s3(down="refused")], vs)
    assert all(x.skip for x in p.place(vs[1], both_down).plans)


@st.composite
def troubled_contexts(draw: st.DrawFn) -> PolicyContext:
    c = draw(contexts())
    tiers = {}
    for name, t in c.tiers.items():
        tiers[name] = dataclasses.replace(
            t, write_latency_s=draw(st.one_of(st.none(), st.floats(0, 0.2))),
            available=draw(st.booleans()) or name == "disk", queue_depth=draw(st.integers(0, 5)),
            backlog_bytes=draw(st.integers(0, 512)) * MB,
        )
    return dataclasses.replace(c, tiers=tiers)


@settings(max_examples=300, deadline=None)
@given(troubled_contexts(), st.floats(1, 600), st.booleans())
def test_every_version_not_yet_held_goes_to_at_least_one_available_durable_tier(
    c: PolicyContext, bound: float, direct: bool
) -> None:
    p = ThroughputAdaptive(max_remote_lag_s=bound, direct_to_remote=direct)
    for v in c.versions:
        v = dataclasses.replace(v, tiers=frozenset())
        taken = [x.tier for x in p.place(v, c).plans if not x.skip]
        assert taken, p.place(v, c)
        assert all(c.tiers[name].available for name in taken)
