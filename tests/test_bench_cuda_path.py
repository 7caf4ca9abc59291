"""The CUDA-path bench (bench/cuda_path.py) as a CPU dry run: its checks and what it reports, not how fast.

The figures need a GPU (docs/benchmarks.md, "GPU (CUDA) path"); CI has none, so this keeps the
script and its bit-for-bit checks working.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import cuda_path


def test_dry_run_on_cpu_restores_bit_exact_from_ram_and_disk_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = cuda_path.main(["--device", "cpu", "--size", "8MB", "--rounds", "2", "--no-agent", "--no-dcp",
                         "--work", str(tmp_path), "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "cuda_path.json").read_text())
    assert res["errors"] == []
    assert res["state"]["dtypes"] == ["torch.bfloat16", "torch.float32"]
    rows = res["rows"]
    assert len(rows["tc.save_wait"]["runs"]) == 2 and len(rows["d2h.pageable"]["runs"]) == 2
    assert "d2h.pinned" not in rows  # no CUDA: no pinned buffer
    assert set(rows["restore.ram.into"]["read_from"]) == {"ram"}
    assert set(rows["restore.disk.into"]["read_from"]) == {"disk"}
    assert set(rows["restore.disk.new"]["read_from"]) == {"disk"}
    assert list(tmp_path.glob("tc-cuda-*")) == []  # its work directory is removed


def test_check_same_names_a_flipped_bit_and_a_tensor_that_is_not_the_one_passed_in_into() -> None:
    want = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "b": torch.ones(4, dtype=torch.bfloat16),
            "step": 3}
    same = {"a": want["a"].clone(), "b": want["b"].clone(), "step": 3}
    assert cuda_path.check_same(same, want, "x", device="cpu", into=same) == []
    flipped = {"a": want["a"].contiguous(), "b": want["b"].clone(), "step": 3}
    flipped["b"].view(torch.int16)[2] ^= 1  # one bit of one bf16 value
    assert cuda_path.check_same(flipped, want, "x", device="cpu") == ["x: b: bytes differ"]
    assert cuda_path.check_same(same, want, "x", device="cpu", into=flipped) == [
        "x: a: not the tensor passed in into=", "x: b: not the tensor passed in into="]
    assert cuda_path.check_same({"a": want["a"]}, want, "x", device="cpu") == ["x: other keys (1 tensors vs 2)"]
