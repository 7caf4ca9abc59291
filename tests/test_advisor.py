"""The checkpoint-interval advisor: the formulas against worked examples, plans, inputs, and the loop."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.advisor import (
    Advisor,
    Figure,
    PlanInputs,
    availability,
    availability_optimal,
    daly,
    measured_inputs,
    plan,
    snapshot_rate,
    when,
    young,
)
from tiercache.cli import app, human_bytes, human_duration
from tiercache.config import parse_duration
from tiercache.sizing import Sizing


def _inputs(mttf: float = 10800.0, save: float = 2.0, ttl: float = 3.0, restore: float = 4.0,
            restart: float = 5.0, level: str = "local") -> PlanInputs:
    return PlanInputs(level, Figure(mttf, "given"), Figure(save, "measured"), Figure(ttl, "measured"),
                      Figure(restore, "estimated"), Figure(restart, "assumed"))


# ---------------------------------------------------------------------------------------------
# The formulas


def test_daly_worked_example_24h_mtbf_5min_dump_gives_about_117_minutes() -> None:
    # Daly 2006: M = 24 h, delta = 5 min. Young's first order gives exactly 120 min.
    assert young(300.0, 86400.0) == pytest.approx(7200.0, rel=1e-12)
    minutes = daly(300.0, 86400.0) / 60.0
    x = 300.0 / (2 * 86400.0)
    assert minutes == pytest.approx((120.0 * (1 + math.sqrt(x) / 3 + x / 9) - 5.0), rel=1e-12)
    assert round(minutes) == 117 and abs(minutes - 116.69) < 0.01


def test_daly_with_a_dump_longer_than_twice_the_mtbf_is_the_mtbf() -> None:
    assert daly(500.0, 200.0) == 200.0


def test_availability_optimal_formula_and_that_it_maximises_availability() -> None:
    ts, tf, tr = 60.0, 10800.0, 600.0
    tc = availability_optimal(ts, tf, tr)
    assert tc == pytest.approx(ts + math.sqrt(2 * (tf + tr) * ts + ts**2), rel=1e-12)
    assert tc == pytest.approx(1231.1537, abs=1e-3)
    best = availability(tc, ts, tf, tr)
    assert best == pytest.approx((1 - ts / tc) * tf / (tf + tr + tc / 2), rel=1e-12)
    for other in (tc * 0.9, tc * 0.99, tc * 1.01, tc * 1.1, young(ts, tf), young(ts, tf) + ts):
        assert availability(other, ts, tf, tr) < best


def test_availability_optimal_tends_to_young_when_save_and_recovery_are_small() -> None:
    # Ts << Tr << Tf: the two optima meet (2410.18124).
    assert availability_optimal(1.0, 1e7, 10.0) / young(1.0, 1e7) == pytest.approx(1.0, abs=3e-4)


def test_availability_is_zero_when_the_interval_is_all_save() -> None:
    assert availability(2.0, 2.0, 100.0, 1.0) == 0.0 and availability(1.0, 2.0, 100.0, 1.0) == 0.0


# ---------------------------------------------------------------------------------------------
# Plans


def test_plan_uses_the_availability_optimum_with_recovery_restart_restore_and_time_to_level() -> None:
    p = plan(_inputs())
    tr = 5.0 + 4.0 + 3.0
    assert p.recovery == tr
    assert p.interval == p.optimum == availability_optimal(2.0, 10800.0, tr)
    assert p.bound is None
    assert p.young == young(2.0, 10800.0) + 2.0 and p.daly == daly(2.0, 10800.0) + 2.0
    assert p.goodput == availability(p.interval, 2.0, 10800.0, tr)
    labels = [row[0] for row in p.table()]
    assert sorted(labels) == sorted(["advised", "0.25x advised", "0.5x advised", "2x advised", "4x advised", "Young",
                                     "Daly"])
    assert [row[1] for row in p.table()] == sorted(row[1] for row in p.table())
    assert max(g for _, _, g in p.table()) == p.goodput
    doc = p.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["interval_s"] == p.interval and doc["inputs"]["save_wait"] == {"seconds": 2.0, "source": "measured",
                                                                              "note": ""}
    assert len(doc["curve"]) == 48 and max(g for _, g in doc["curve"]) <= p.goodput


def test_plan_bounds_and_the_time_to_level_floor() -> None:
    assert plan(_inputs(), min_interval=1000.0).interval == 1000.0
    assert plan(_inputs(), min_interval=1000.0).bound == "min_interval"
    capped = plan(_inputs(), max_interval=60.0)
    assert (capped.interval, capped.bound) == (60.0, "max_interval")
    slow = plan(_inputs(ttl=900.0))
    assert (slow.interval, slow.bound) == (900.0, "time_to_level") and slow.optimum < 900.0


def test_plan_refuses_missing_or_bad_inputs_naming_them() -> None:
    missing = PlanInputs("local", None, Figure(1.0, "measured"), None, Figure(1.0, "given"), Figure(0.0, "assumed"))
    with pytest.raises(tiercache.InvalidArgumentError, match="mttf, time_to_level"):
        plan(missing)
    with pytest.raises(tiercache.InvalidArgumentError, match="mttf must be positive"):
        plan(_inputs(mttf=0.0))
    with pytest.raises(tiercache.InvalidArgumentError, match="below min_interval"):
        plan(_inputs(), min_interval=10.0, max_interval=5.0)


def test_measured_inputs_say_where_each_figure_comes_from() -> None:
    status = {"save_wait": {"ewma": 0.5, "count": 7, "last": 0.4, "recent": []},
              "time_to": {"local": {"ewma": 3.0, "count": 6, "last": 3.0, "recent": []}}}
    rates = snapshot_rate({"tiers": {"disk": {"read": {"bps": 1000.0}, "write": {"bps": 500.0}}}})
    got = measured_inputs(level="local", tiers=["ram", "disk"], status=status, rate=rates, nbytes=4000,
                          mttf=Figure(3600.0, "given"), restart=Figure(0.0, "assumed"))
    assert got.save_wait == Figure(0.5, "measured", "EWMA of 7 saves")
    assert got.time_to_level == Figure(3.0, "measured", "EWMA of 6 saves reaching local")
    assert got.restore == Figure(4.0, "estimated", "newest version's size / disk read speed")
    # Nothing measured: estimates from speeds, the user's figures win, and the rest is unknown.
    bare = measured_inputs(level="local", tiers=["disk"], status=None, rate=rates, nbytes=4000, mttf=None,
                           restart=Figure(0.0, "assumed"), given={"save_wait": 9.0})
    assert bare.save_wait == Figure(9.0, "given")
    assert bare.time_to_level == Figure(8.0, "estimated", "newest version's size / disk write speed")
    assert bare.missing() == ["mttf"]
    unknown = measured_inputs(level="remote", tiers=["disk", "s3"], status=None, rate=rates, nbytes=None,
                              mttf=None, restart=Figure(0.0, "assumed"))
    assert unknown.missing() == ["mttf", "save_wait", "time_to_level", "restore"]


def test_measured_restores_and_restarts_replace_estimates_and_defaults_and_say_when() -> None:
    # Issue 47 item 7: restores the trainers reported and restarts the agent saw are the plan's figures.
    status = {"restore": {"ewma": 2.5, "count": 24, "last": 2.0, "recent": [[1764213125.0, 2.0]]},
              "restart": {"ewma": 11.0, "count": 6, "last": 8.0, "recent": [[1764213120.0, 8.0]]}}
    rates = snapshot_rate({"tiers": {"disk": {"read": {"bps": 1000.0}, "write": {"bps": 500.0}}}})
    got = measured_inputs(level="local", tiers=["ram", "disk"], status=status, rate=rates, nbytes=4000,
                          mttf=None, restart=Figure(0.0, "assumed", "default (advisor.restart, --restart)"))
    assert got.restore == Figure(2.5, "measured", "EWMA of 24 restores, newest 2025-11-27 03:12:05 UTC")
    assert got.restart == Figure(11.0, "measured", "EWMA of 6 restarts (the node agent saw the trainers leave and "
                                                   "return), newest 2025-11-27 03:12:00 UTC")
    # What the user gave or configured wins over what was measured.
    mine = measured_inputs(level="local", tiers=["ram", "disk"], status=status, rate=rates, nbytes=4000, mttf=None,
                           restart=Figure(120.0, "given", "config advisor.restart"), given={"restore": 1.0})
    assert (mine.restore, mine.restart) == (Figure(1.0, "given"), Figure(120.0, "given", "config advisor.restart"))


def test_sizing_follows_the_worked_example_of_docs_config() -> None:
    gib, mib = 1 << 30, 1 << 20
    every_10min = Sizing(10 * gib, 600.0, 2 * gib, 100 * mib, 5, True)
    every_minute = Sizing(10 * gib, 60.0, 2 * gib, 100 * mib, 5, True)
    every_3s = Sizing(10 * gib, 3.0, 2 * gib, 100 * mib, 5, True)
    assert [(s.in_flight, s.arena_bytes, s.disk_bytes, s.s3_every) for s in (every_10min, every_minute, every_3s)] == [
        (1, 20 * gib, 70 * gib, 1), (1, 20 * gib, 70 * gib, 2), (2, 30 * gib, 70 * gib, 35)]
    assert (round(every_10min.s3_needed_bps / mib, 1), every_10min.s3_lag_s) == (17.1, 102.4)
    assert (round(every_minute.s3_needed_bps / mib, 1), every_minute.s3_lag_s) == (170.7, 204.8)
    assert Sizing(10 * gib, 600.0, None, None, None, False).disk_bytes is None
    assert Sizing(10 * gib, 600.0, None, None, 5, False).disk_bytes == 60 * gib
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    for row in ("| `[ram] capacity` | 20 GiB | 20 GiB |",
                "| `[disk] capacity` | 70 GiB (`10 GiB × (5 + 2)`) | 70 GiB |",
                "| S3 needs, for every version | 17.1 MiB/s | 170.7 MiB/s |",
                "| S3 gets | every version, 102.4 s after its save | 1 version in 2, within 204.8 s |"):
        assert row in doc.splitlines()
    assert "Saved every 3 s instead, the disk takes 5 s per version: `n` = 2 and the arena needs 30 GiB." in doc


def test_plan_prints_the_sizing_advice_from_measurements(tmp_path: Path) -> None:
    cfg = tmp_path / "tiercache.toml"
    cfg.write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n'
                   '[policy]\nname = "write-through"\nparams = { keep = 5 }\n')
    with tiercache.open(cfg) as cache:
        for step in range(3):
            cache.save({"w": torch.full((1 << 18,), float(step))}, step=step).wait("local")
    res = CliRunner().invoke(app, ["--config", str(cfg), "plan", "--mttf", "3h", "--json"])
    assert res.exit_code == 0, res.output
    sized = json.loads(res.output)["sizing"]
    with tiercache.open(cfg) as cache:
        status = cache.status()
        newest = cache.versions()[-1]
    assert status is not None
    saved = sorted(v["created_at"] for v in status["versions"].values())
    interval = sorted(b - a for a, b in itertools.pairwise(saved))[1]
    wd = status["meter"]["tiers"]["disk"]["write"]["bps"]
    n = max(1, math.ceil(newest.nbytes / wd / interval))
    assert sized == {
        "state_bytes": 1 << 20, "interval_s": interval,
        "interval_source": "the median of 2 intervals between saves, measured", "first_tier": "disk",
        "first_write_bps": wd, "s3_write_bps": None, "keep": 5, "arena_bytes": (1 << 20) * (1 + n),
        "disk_bytes": 6 << 20, "s3_needed_bps": None, "s3_every": None, "s3_lag_s": None}
    text = CliRunner().invoke(app, ["--config", str(cfg), "plan", "--mttf", "3h"]).output.splitlines()
    assert text[-3:] == [
        f"sizing: versions of 1.0 MiB (the newest, main@2), saved every {human_duration(interval)} (the median of 2 "
        "intervals between saves, measured)",
        f"  [ram] capacity  >= {human_bytes(sized['arena_bytes'])}: the version being copied in + {n} disk has not "
        f"written yet (disk writes one in {human_duration(newest.nbytes / wd)} at {human_bytes(int(wd))}/s, "
        "measured)",
        "  [disk] capacity >= 6.0 MiB: 5 versions kept (write-through keep = 5) + 1 being written",
    ]


def test_parse_duration() -> None:
    assert [parse_duration(v) for v in ("3h", "50000h", "5 min", "90s", "2d", 42, "1.5h")] == [
        10800.0, 180_000_000.0, 300.0, 90.0, 172800.0, 42.0, 5400.0]
    for bad in ("3 weeks", "-1h", "h", True, float("inf")):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ---------------------------------------------------------------------------------------------
# The advisor in a loop


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _run(advisor: Advisor, clock: FakeClock, steps: range, cost: float, saved: list[int],
         save: object = None) -> None:
    for step in steps:
        if advisor.should_save(step):
            saved.append(step)
            if callable(save):
                save(step)
            clock.t += cost  # the save's cost to training, as the loop's next step sees it
        clock.t += 1.0  # one training step


def test_advisor_times_steps_and_saves_and_converts_the_interval_to_steps() -> None:
    clock = FakeClock()
    inputs = _inputs(mttf=2500.0, save=0.0, ttl=0.0, restore=0.0, restart=0.0)
    published: list[tuple[int, object]] = []
    advisor = Advisor(lambda: inputs, clock=clock, publish=lambda step, adv: published.append((step, adv)))
    saved: list[int] = []
    _run(advisor, clock, range(400), 2.0, saved)
    # Before a saving step is timed, the cache's save wait (0 here) would make every step a save
    # point; the advisor's own measurement (2 s per save) then takes over.
    assert advisor.step_time == 1.0 and advisor.save_cost == pytest.approx(2.0)
    expected = round(availability_optimal(2.0, 2500.0, 0.0))
    assert advisor.interval_steps == expected == 102
    gaps = [b - a for a, b in itertools.pairwise(saved)]
    assert gaps[-2:] == [expected, expected]
    assert published[-1][0] == 399 and published[-1][1]["interval_steps"] == expected  # type: ignore[index]


def test_advisor_bounds() -> None:
    clock = FakeClock()
    advisor = Advisor(lambda: _inputs(mttf=2500.0, save=2.0, ttl=0.0, restore=0.0, restart=0.0), clock=clock,
                      max_interval=10.0)
    saved: list[int] = []
    _run(advisor, clock, range(60), 2.0, saved)
    # Unbounded, the optimum would be 102 steps; the bound holds it at 10 s = 10 steps.
    assert advisor.interval_steps == 10
    assert saved[0] == 0 and {b - a for a, b in itertools.pairwise(saved)} == {10}
    assert advisor.plan() is not None and advisor.plan().bound == "max_interval"  # type: ignore[union-attr]
    with pytest.raises(tiercache.InvalidArgumentError):
        Advisor(lambda: _inputs(), min_interval=5.0, max_interval=1.0)


def test_end_to_end_loop_save_frequency_follows_the_measured_save_cost(tmp_path: Path) -> None:
    """A real cache saves when the advisor says; the save's cost to training quadruples midway.

    The clock is fake so that the costs are exact: each step takes 1 s, each save 2 s, then 8 s.
    """
    clock = FakeClock()
    with tiercache.open({"disk": {"path": str(tmp_path)}, "advisor": {"mttf": 2500}}) as cache:
        advisor = cache.advisor(level="local", clock=clock)
        state = {"w": torch.zeros(64)}
        saved: list[int] = []

        def save(step: int) -> None:
            state["w"].fill_(step)
            cache.save(state, step=step).wait("local")

        _run(advisor, clock, range(0, 500), 2.0, saved, save)
        before = list(saved)
        _run(advisor, clock, range(500, 5000), 8.0, saved, save)
        status = cache.status()
        versions = cache.versions()
    # The figures the cache measured for real (milliseconds) barely move the optimum.
    fast, slow = round(availability_optimal(2.0, 2500.0, 0.0)), round(availability_optimal(8.0, 2500.0, 0.0))
    assert (fast, slow) == (102, 208)
    gaps = [b - a for a, b in itertools.pairwise(saved)]
    early = [b - a for a, b in itertools.pairwise(before)]
    assert early[1:] and set(early[1:]) == {fast}
    assert gaps[-3:] == [slow, slow, slow]
    assert all(fast <= g <= slow for g in gaps[len(early):])
    assert [v.step for v in versions] == saved
    assert status is not None and status["training"]["main"]["step"] == 4999
    assert status["advice"]["interval_steps"] == slow and status["advice"]["inputs"]["mttf"]["seconds"] == 2500.0


def test_cache_advisor_needs_an_mttf_and_a_known_level(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(tiercache.InvalidArgumentError, match="mean time to failure"):
            cache.advisor()
        with pytest.raises(tiercache.InvalidArgumentError, match="unknown level 'remote'"):
            cache.advisor(mttf="3h", level="remote")
        assert cache.levels == ["staged", "local", "durable"]
    assert not (tmp_path / "stats").exists()  # refused before anything was recorded


# ---------------------------------------------------------------------------------------------
# tiercache plan


def _cfg(tmp_path: Path) -> Path:
    cfg = tmp_path / "tiercache.toml"
    cfg.write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n')
    return cfg


def test_plan_json_with_every_input_given_is_exact(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["--config", str(_cfg(tmp_path)), "plan", "--gpu-mtbf", "50000h", "--gpus", "16384",
                                   "--save-wait", "2", "--time-to-level", "3", "--restore", "4", "--restart", "5",
                                   "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    mttf = 50000 * 3600 / 16384
    assert doc["inputs"]["mttf"] == {"seconds": mttf, "source": "given", "note": ""}
    names = ("save_wait", "time_to_level", "restore", "restart")
    assert {k: doc["inputs"][k]["source"] for k in names} == dict.fromkeys(names, "given")
    assert doc["interval_s"] == availability_optimal(2.0, mttf, 12.0)
    assert doc["young_s"] == young(2.0, mttf) + 2.0 and doc["daly_s"] == daly(2.0, mttf) + 2.0


def test_plan_from_measured_figures_prints_the_interval_and_the_sources(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with tiercache.open(cfg) as cache:
        for step in range(3):
            cache.save({"w": torch.full((4096,), float(step))}, step=step).wait("local")
    res = CliRunner().invoke(app, ["--config", str(cfg), "plan", "--mttf", "3h", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    with tiercache.open(cfg) as cache:
        status = cache.status()
    assert status is not None
    newest = when(status["save_wait"]["recent"][-1][0])
    assert doc["inputs"]["save_wait"] == {"seconds": doc["inputs"]["save_wait"]["seconds"], "source": "measured",
                                          "note": f"EWMA of 3 saves, newest {newest}"}
    assert doc["inputs"]["time_to_level"]["note"] == (
        f"EWMA of 3 saves reaching local, newest {when(status['time_to']['local']['recent'][-1][0])}")
    assert doc["inputs"]["restore"]["source"] == "estimated"
    assert doc["inputs"]["restart"]["source"] == "assumed"
    text = CliRunner().invoke(app, ["--config", str(cfg), "plan", "--mttf", "3h"])
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0].startswith("advised interval: ") and "expected goodput" in lines[0]
    assert [ln.split()[0] for ln in lines[1:4]] == ["availability-optimal", "Young", "Daly"]
    assert any(ln.split()[:2] == ["save", "wait"] and "measured" in ln for ln in lines)


def test_plan_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    for args, needle in ((["--gpus", "8"], "--gpu-mtbf and --gpus go together"),
                         (["--mttf", "3 weeks"], "expected a duration"),
                         (["--mttf", "3h", "--level", "remote"], "unknown level 'remote'"),
                         (["--mttf", "3h"], "cannot advise an interval without save_wait")):
        res = CliRunner().invoke(app, ["--config", str(cfg), "plan", *args])
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output and len(res.output.strip().splitlines()) == 1
