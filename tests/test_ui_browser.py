"""tiercache ui in a real browser: headless Chromium renders the page while a trainer writes to the cache.

Needs Debian's ``chromium`` (``./dev.sh setup`` installs it where it can). The screenshot is
saved under the test's tmp dir; with ``TEST_TIERCACHE_SCREENSHOT=PATH`` it is also copied to
PATH, which is how ``docs/ui.png`` is made::

    TEST_TIERCACHE_SCREENSHOT=docs/ui.png .venv/bin/python -m pytest -q tests/test_ui_browser.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _browser import Browser, chromium_path  # helpers next to the tests
from _ui import ROOT, stop, ui_process

pytestmark = pytest.mark.skipif(
    chromium_path() is None, reason="chromium is not installed (./dev.sh setup installs it where root and apt-get can)")

LAG = "document.querySelector('#lag td[data-branch=main][data-level=local] b')?.textContent"


def _dag(browser: Browser) -> list[dict[str, str]]:
    return browser.eval("[...document.querySelectorAll('#dag .version')].map(g => ({id: g.dataset.id, "
                        "branch: g.dataset.branch, step: g.dataset.step, text: g.textContent, "
                        "cls: g.getAttribute('class')}))")


def _line(proc: subprocess.Popen[str], word: str) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(word + " "), line + proc.stdout.read()
    return json.loads(line.split(" ", 1)[1])


def test_the_page_shows_lineage_residency_and_lag_live_while_a_trainer_saves(tmp_path: Path) -> None:
    cfg = tmp_path / "tiercache.toml"
    cfg.write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n[ui]\nstatus_interval = 0.2\n[advisor]\nmttf = "3h"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    trainer = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_ui_trainer.py"), str(cfg)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert trainer.stdin is not None
    ui, url = ui_process(cfg, "--refresh", "0.3")
    try:
        with Browser() as browser:
            first = _line(trainer, "phase1")
            browser.goto(url)
            # Three versions are local; the trainer's advisor reported step 10: 7 steps behind.
            assert browser.wait_for(f"{LAG} === '7 steps' && {LAG}") == "7 steps"
            dag = _dag(browser)
            assert [(d["id"], d["branch"], d["step"]) for d in dag] == [
                (first[2], "main", "3"), (first[1], "main", "2"), (first[0], "main", "1")]
            assert dag[0]["text"].startswith(first[2][:10] + "main@3main")  # id, where, branch head label

            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            ids = _line(trainer, "phase2")
            # The saves landed: main@13 is local and the advisor saw step 13 -> no lag.
            assert browser.wait_for(f"{LAG} === '0 steps' && document.querySelectorAll('#dag .version').length "
                                    f"=== {len(ids)} && {LAG}") == "0 steps"
            dag = {d["id"]: d for d in _dag(browser)}
            finetune, v11, v12, v13 = ids[3:]
            assert dag[finetune]["branch"] == "finetune" and "finetune@3finetune" in dag[finetune]["text"]
            assert "tag: best" in dag[first[2]]["text"]
            assert "rolled" in dag[v12]["cls"] and "rolled back" in dag[v12]["text"]
            assert "rolled" not in dag[v13]["cls"] and "rolled" not in dag[v11]["cls"]
            states = browser.eval("[...document.querySelectorAll('#residency tr[data-id]')].map(r => "
                                  "[r.dataset.id, r.querySelector('td[data-tier=disk]').dataset.state])")
            assert states == [[i, "held"] for i in sorted(ids, reverse=True)]
            advice = browser.eval("document.querySelector('#advice').textContent")
            assert advice.count("from the trainer's advisor") == 1
            assert browser.eval("document.querySelector('#advised').textContent").endswith(("s", "m", "h"))
            assert browser.eval("document.querySelectorAll('#throughput-chart polyline, #throughput-chart circle')"
                                ".length") > 0
            assert browser.eval("document.querySelector('#trainer').textContent").startswith(
                f"trainer pid {trainer.pid}: live")
            # A version's manifest summary, and its dedup against its parent (layer.weight changed,
            # the bias too: nothing shared).
            browser.eval(f"document.querySelector('#dag .version[data-id=\"{v13}\"]')"
                         ".dispatchEvent(new MouseEvent('click'))")
            dedup = browser.wait_for("document.querySelector('#dedup')?.textContent")
            assert dedup.startswith("0 chunks (0 B, 0.0 %) shared with the parent")
            assert browser.eval("document.querySelector('#error').hidden") is True
            shot = browser.screenshot(tmp_path / "ui.png")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("TEST_TIERCACHE_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["TEST_TIERCACHE_SCREENSHOT"])
    finally:
        stop(ui)
        if trainer.poll() is None:
            trainer.stdin.write("stop\n")
            trainer.stdin.flush()
        trainer.wait(60)
    assert trainer.returncode == 0
