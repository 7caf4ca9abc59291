"""The policy's skips are logged as skips: at INFO, the first at once, repeats as one summary line.

``SkipLog`` on its own with a fake clock (what each line says, and when), and a real cache whose
policy coalesces S3 for every version but the first, on the real S3 server: one line for the
first skip, one summary for the rest, nothing at WARNING.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from _policies import COALESCED

import tiercache
from tiercache.config import S3Config
from tiercache.pipeline.skips import SkipLog

LOGGER = "tiercache.pipeline.skips"


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_repeated_skips_of_a_tier_are_one_info_line_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    skips = SkipLog(every=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, LOGGER):
        for i in range(50):  # 50 skips in 49 s: the first is logged, 49 are counted
            now[0] = float(i)
            skips.skipped("s3", f"v{i}", f"coalesced: {i}")
        skips.skipped("disk", "d0", "full")  # another tier: its own line
        assert _lines(caplog) == [(logging.INFO, "version v0 skipped for s3: coalesced: 0"),
                                  (logging.INFO, "version d0 skipped for disk: full")]
        now[0] = 61.0  # the next skip after the minute closes it: one line for all 50
        skips.skipped("s3", "v50", "coalesced: 50")
        now[0] = 70.0
        skips.skipped("s3", "v51", "coalesced: 51")  # counted in the next minute
        now[0] = 75.0
        skips.flush()  # the engine closes: what is counted is said
        skips.flush()  # and said once
        now[0] = 500.0
        skips.skipped("s3", "v52", "coalesced: 52")  # long after: logged as it comes again
    assert _lines(caplog)[2:] == [
        (logging.INFO, "50 more version(s) skipped for s3 in the last 61 s, the newest v50: coalesced: 50"),
        (logging.INFO, "1 more version(s) skipped for s3 in the last 14 s, the newest v51: coalesced: 51"),
        (logging.INFO, "version v52 skipped for s3: coalesced: 52"),
    ]


def test_a_policy_that_coalesces_s3_logs_one_line_and_one_summary_at_info(
    tmp_path: Path, s3_config: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"disk": {"path": str(tmp_path / "disk")}, "s3": s3_config.model_dump(mode="json"),
           "ram": {"capacity": "8MiB"}, "policy": {"name": "tests._policies:CoalesceAfterFirst"}}
    state = {"w": torch.zeros(1024)}
    with caplog.at_level(logging.INFO, "tiercache"), tiercache.open(cfg) as cache:
        handles = []
        for step in range(1, 7):
            state["w"].fill_(step)
            handles.append(cache.save(state, step=step))
        cache.flush()
        ids = [h.version for h in handles]
        assert [h.done("remote") and h.future("remote").exception() is None for h in handles] == \
                [True] + [False] * 5
    skipped = _lines(caplog)
    assert skipped[0] == (logging.INFO, f"version {ids[1]} skipped for s3: {COALESCED}"), skipped
    assert len(skipped) == 2 and skipped[1][0] == logging.INFO and re.fullmatch(
        rf"4 more version\(s\) skipped for s3 in the last \d+ s, the newest {ids[5]}: {re.escape(COALESCED)}",
        skipped[1][1]), skipped
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
