"""``python -m bench tensors`` runs every kind, checks every restore bit-exact and reports each ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tensors


def test_every_kind_runs_and_the_ratios_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tensors, "OUT", tmp_path / "out")
    assert tensors.main(["--counts", "4,6", "--rounds", "1", "--dcp-max", "4", "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "out" / "tensors.json").read_text())
    assert doc["rounds"] == 1 and sorted(doc["results"]) == ["4", "6"]
    tc = {"tc.save_wait", "tc.save_local", "tc.open", "tc.restore", "tc.restore_into", "tc.manifest", "raw.read",
          "raw.read_cached", "into.ask"}
    assert all(set(r) == tc | {"torch.save", "torch.load", "dcp.save", "dcp.load"} for r in doc["results"]["4"])
    assert all(set(r) == tc | {"torch.save", "torch.load"} for r in doc["results"]["6"])  # past --dcp-max
    out = capsys.readouterr().out
    assert "restore into new tensors / torch.load" in out and "restore into existing / raw O_DIRECT read" in out
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the work directory is gone
