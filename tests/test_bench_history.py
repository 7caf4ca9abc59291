"""``python -m bench history`` at a tiny size: every row, the manifests each step parses, and the pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import history


def test_history_rows_parse_only_the_restored_manifest_and_the_pairs_alternate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert history.main(["--versions", "1,4", "--no-s3", "--repeat", "1", "--leaves", "6", "--leaf-floats", "4",
                         "--pairs", "2", "--dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "history.json").read_text())
    assert [(r["tier"], r["versions"]) for r in doc["rows"]] == [("disk", 1), ("disk", 4)]
    # The catalog reads its index: opening and listing parse no manifest, a restore exactly its own.
    assert all((r["open_parsed"], r["ls_parsed"], r["restore_parsed"]) == (0, 0, 1) for r in doc["rows"])
    [pair] = doc["paired"]
    assert pair["tier"] == "disk" and pair["versions"] == 4 and len(pair["rounds"]) == 2
    assert all(set(r) == {"one", "many"} for r in pair["rounds"])
    out = capsys.readouterr().out
    assert "open + restore, 1 version" in out and "| disk | 4 |" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.json"]  # the caches are gone
