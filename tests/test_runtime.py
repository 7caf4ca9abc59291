"""The typed runtime-status model (tiercache.runtime): old status documents load, merging is typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tiercache
from tiercache.runtime import AgentStats, CacheStats, ErrorStats, TierRoom, TierStats
from tiercache.status import STATUS_KEY, read_status

#: A status.json as the previous version (untyped dicts) wrote it: every field it had, in its shapes.
OLD_STATUS = """{"schema_version": 1, "pid": 4242, "writer": "trainer", "started_at": 100.0, "updated_at": 130.5,
 "closed": true, "levels": ["staged", "local", "durable"],
 "staged": {"version": "01B", "branch": "main", "step": 20, "at": 110.0},
 "training": {"main": {"step": 25, "at": 115.0}},
 "newest": {"main": {"staged": {"version": "01B", "step": 20, "created_at": 110.0, "reached_at": 110.25},
                     "local": {"version": "01A", "step": 10, "created_at": 100.0, "reached_at": 103.5}}},
 "lag": {"main": {"staged": {"steps": 5, "seconds": 5.0}, "local": {"steps": 15, "seconds": 15.0}, "durable": null}},
 "lag_history": [{"t": 115.0, "branch": "main", "step": 25,
                  "levels": {"staged": {"steps": 5, "seconds": 5.0}, "durable": null}},
                 {"t": 116.0, "branch": "ft", "step": null, "levels": {}}],
 "save_wait": {"ewma": 0.4, "last": 0.75, "count": 2, "recent": [[100.25, 0.25], [110.75, 0.75]]},
 "time_to": {"local": {"ewma": 3.5, "last": 3.5, "count": 1, "recent": [[103.5, 3.5]]}},
 "restore": {"ewma": null, "last": null, "count": 0, "recent": []},
 "restart": {"ewma": 12.0, "last": 12.0, "count": 1, "recent": [[120.0, 12.0]]},
 "queues": {"staged": 0, "local": 1, "durable": 1},
 "versions": {"01A": {"branch": "main", "step": 10, "created_at": 100.0, "wait_s": 0.25,
                      "levels": {"staged": {"state": "held", "at": 100.5, "reason": ""},
                                 "local": {"state": "held", "at": 103.5, "reason": ""},
                                 "durable": {"state": "pending", "at": null, "reason": ""}}},
              "01B": {"branch": "main", "step": 20, "created_at": 110.0, "wait_s": 0.75,
                      "levels": {"staged": {"state": "held", "at": 110.25, "reason": ""},
                                 "local": {"state": "skipped", "at": 110.0, "reason": "the policy skipped disk"},
                                 "durable": {"state": "failed", "at": 111.0,
                                             "reason": "TierUnavailableError: disk: device gone"}}}},
 "errors": [{"t": 111.0, "version": "01B", "branch": "main", "step": 20, "level": "durable",
             "error": "TierUnavailableError", "message": "disk: device gone"}],
 "meter": {"tiers": {"disk": {"write": {"bps": 1000.0, "transfers": 2, "total_bytes": 4096}}},
           "codecs": {}, "history": [{"t": 103.5, "tier": "disk", "direction": "write", "bytes": 4096,
                                      "seconds": 4.096}]},
 "advice": {"interval_s": 99.0, "inputs": {"level": "local"}}}"""


def test_a_status_json_of_the_previous_version_loads_unchanged(tmp_path: Path) -> None:
    (tmp_path / "stats").mkdir()
    (tmp_path / STATUS_KEY).write_text(OLD_STATUS)
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as reader:  # a viewer: it writes nothing
        got = reader.status()
    assert got == json.loads(OLD_STATUS)
    typed = read_status(OLD_STATUS.encode())
    assert typed is not None
    assert typed.versions["01B"].levels["durable"].state == "failed" and typed.lag["main"]["durable"] is None
    assert typed.restart.recent == [[120.0, 12.0]] and typed.staged is not None and typed.staged.step == 20


def test_an_older_status_without_newer_fields_loads_with_defaults() -> None:
    """Fields added later (``writer``, ``restart``, ``advice``...) take their defaults; unknown ones are ignored."""
    doc = {"schema_version": 1, "pid": 7, "started_at": 1.0, "updated_at": 2.0, "closed": False,
           "levels": ["staged"], "staged": None, "training": {}, "newest": {}, "lag": {}, "lag_history": [],
           "save_wait": {"ewma": None, "last": None, "count": 0, "recent": []}, "time_to": {},
           "queues": {}, "versions": {}, "errors": [], "from_the_future": {"x": 1}}
    typed = read_status(json.dumps(doc).encode())
    assert typed is not None
    assert (typed.writer, typed.restart.count, typed.advice, typed.meter) == ("trainer", 0, None, None)
    assert "from_the_future" not in typed.to_json()
    # Not a status: another schema, or a field of the wrong type, is no status (a hint, never an error).
    assert read_status(json.dumps({**doc, "schema_version": 2}).encode()) is None
    assert read_status(json.dumps({**doc, "queues": {"local": "many"}}).encode()) is None


def test_stats_merge_the_agent_as_a_typed_operation() -> None:
    mine = CacheStats(meter={"tiers": {}}, errors=ErrorStats(lost_versions=1, recent=["01A: lost"]),
                      tiers={"ram": TierStats(capacity=8, used_bytes=0),
                             "disk": TierStats(capacity=None, used_bytes=4,
                                               room=TierRoom(full=False, free_bytes=None, reclaimable_bytes=0,
                                                             next_version_bytes=0, state="available"))})
    agent = AgentStats(pid=9, started_at=1.0, socket="/s", cache="c", lost_versions=2,
                       meter={"tiers": {"disk": {"write": {"bps": 5.0}}}})
    merged = mine.with_agent(agent)
    assert merged.errors == ErrorStats(lost_versions=3, recent=["01A: lost"])
    assert merged.meter == agent.meter and merged.agent is not None and merged.agent.pid == 9
    assert mine.agent is None and mine.errors.lost_versions == 1  # the parts are left as they were
    out = merged.to_json()
    assert "meter" not in out["agent"] and out["meter"] == agent.meter  # the agent's meter is the cache's
    assert out["tiers"]["ram"] == {"capacity": 8, "used_bytes": 0, "available": True, "unavailable": None}
    assert out["tiers"]["disk"]["state"] == "available" and "room" not in out["tiers"]["disk"]
    assert CacheStats.model_validate(out) == merged
    assert "agent" not in mine.to_json()


@pytest.mark.parametrize("bad", [{"state": "gone"}, {"free_bytes": "lots", "state": "full"}])
def test_a_tier_room_that_is_not_one_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="validation error"):
        TierStats.model_validate({"capacity": 1, "used_bytes": 0, "available": True, "unavailable": None, **bad})


def test_a_status_json_longer_than_any_recorder_writes_reads_as_no_status() -> None:
    # status.json sits in a directory other processes may write: a document with more entries than
    # a recorder keeps is not one, and is not validated whole nor served to the ui.
    from tiercache.runtime import LAG_HISTORY, RECENT_ERRORS

    sample = {"t": 1.0, "branch": "main", "step": 1, "levels": {}}
    error = {"t": 1.0, "version": "v", "branch": "main", "step": 1, "level": "local", "error": "E", "message": "m"}
    ok = {"schema_version": 1, "lag_history": [sample] * LAG_HISTORY, "errors": [error] * RECENT_ERRORS}
    got = read_status(json.dumps(ok).encode())
    assert got is not None and len(got.lag_history) == LAG_HISTORY and len(got.errors) == RECENT_ERRORS
    assert read_status(json.dumps({**ok, "lag_history": [sample] * (LAG_HISTORY + 1)}).encode()) is None
    assert read_status(json.dumps({**ok, "errors": [error] * (RECENT_ERRORS + 1)}).encode()) is None
