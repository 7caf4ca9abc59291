"""DCP conformance: the same dcp.save/dcp.load calls on tiercache's storage and on DCP's own file system storage.

Each case runs twice in one process, once with ``FileSystemWriter``/``FileSystemReader`` and once
with tiercache's writer and reader, and the outcomes must be the same: the loaded state bit-exact
on both, or the same exception type on both. The cases follow the single-process checks of
PyTorch's own DCP tests (``test/distributed/checkpoint``): ``test_file_system_checkpoint_cpu.py``
(only tensors, nested containers, bytes and plain values), ``test_format_utils.py``
(``dcp_to_torch_save``: a whole state read without a target), ``test_planner.py`` (missing keys
fail unless the planner allows partial loads) and ``test_state_dict.py`` (optimizer state). The
multi-rank and resharding cases (4 ranks saved, 2 ranks or one process load) are in
``tests/test_dcp.py``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import tiercache
from tiercache.integrations.dcp import TierCacheStorageReader, TierCacheStorageWriter, load_whole

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _optimizer_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "only_tensors": lambda: {"a": torch.randn(64, 32, generator=_g(1)), "b": torch.arange(100)},
    "dtypes": lambda: {"bf16": torch.randn(33, generator=_g(2)).bfloat16(),
                       "f16": torch.randn(7, generator=_g(7)).half(),
                       "i8": torch.arange(-5, 5, dtype=torch.int8), "bool": torch.tensor([True, False, True]),
                       "c64": torch.randn(4, dtype=torch.complex64, generator=_g(3)),
                       "f64": torch.randn(5, dtype=torch.float64, generator=_g(4))},
    "shapes": lambda: {"scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
                       "wide": torch.randn(1, 3000, generator=_g(8)),
                       "strided": torch.randn(16, 8, generator=_g(5)).t()},
    "nested": lambda: {"model": {"layer": {"w": torch.ones(3, 3), "b": torch.zeros(3)}},
                       "list": [torch.full((2,), 7.0), torch.arange(3)], "step": 12, "lr": 0.25, "name": "run"},
    "bytes": lambda: {"blob": io.BytesIO(b"\x00\x01opaque bytes\xff" * 50), "w": torch.ones(2)},
    "optimizer": _optimizer_state,
    "big": lambda: {"w": torch.randn(3_000_000, generator=_g(6))},  # 12 MB: several chunks
}


def _zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state.contiguous())
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    if isinstance(state, io.BytesIO):
        return io.BytesIO()
    return type(state)() if isinstance(state, (int, float, str)) else state


def _plain(state: Any) -> Any:
    """The state as comparable values: tensors as (dtype, shape, bytes), BytesIO as bytes."""
    if isinstance(state, torch.Tensor):
        t = state.contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).tolist()
                if t.numel() else [])
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_plain(v) for v in state]
    if isinstance(state, io.BytesIO):
        return ("bytes", state.getvalue())
    return state


def _storages(tmp_path: Path, cache: tiercache.TierCache, step: int) -> dict[str, tuple[Any, Callable[[], Any]]]:
    fs = tmp_path / f"fs{step}"
    return {"filesystem": (FileSystemWriter(fs), lambda: FileSystemReader(fs)),
            "tiercache": (TierCacheStorageWriter(cache, step=step),
                          lambda: TierCacheStorageReader(cache, f"main@{step}"))}


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", _plain(fn()))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # (DCP's CheckpointException is a BaseException) compared by its type
        return ("raised", type(e).__name__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_saved_state_loads_as_it_does_with_dcps_file_system_storage(tmp_path: Path, case: str) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "cache")}, "chunk_bytes": "4MiB"}) as cache:
        results = {}
        for name, (writer, reader) in _storages(tmp_path, cache, 1).items():
            state = CASES[case]()
            dcp.save(state, storage_writer=writer, no_dist=True)

            def load(reader: Callable[[], Any] = reader) -> Any:
                target = _zeros_like(CASES[case]())
                dcp.load(target, storage_reader=reader(), no_dist=True)
                return target

            results[name] = _outcome(load)
        assert results["tiercache"] == results["filesystem"]
        assert results["tiercache"][0] == "ok"
        assert results["tiercache"][1] == _plain(CASES[case]())


@pytest.mark.parametrize("case", ["only_tensors", "nested", "optimizer"])
def test_a_whole_state_reads_back_without_a_target_as_dcp_to_torch_save_reads_it(tmp_path: Path, case: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = CASES[case]()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "fs"), no_dist=True)
    dcp_to_torch_save(tmp_path / "fs", tmp_path / "fs.pt")
    with tiercache.open({"disk": {"path": str(tmp_path / "cache")}}) as cache:
        dcp.save(CASES[case](), storage_writer=TierCacheStorageWriter(cache, step=1), no_dist=True)
        ours = load_whole(cache, "main")
    assert _plain(ours) == _plain(torch.load(tmp_path / "fs.pt", weights_only=False))


def test_missing_keys_fail_alike_unless_the_planner_allows_a_partial_load(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "cache")}}) as cache:
        outcomes = {}
        for name, (writer, reader) in _storages(tmp_path, cache, 1).items():
            dcp.save({"a": torch.ones(3)}, storage_writer=writer, no_dist=True)
            strict = _outcome(lambda reader=reader: dcp.load({"a": torch.zeros(3), "b": torch.zeros(2)},
                                                           storage_reader=reader(), no_dist=True))
            partial: dict[str, Any] = {"a": torch.zeros(3), "b": torch.zeros(2)}
            dcp.load(partial, storage_reader=reader(), planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=True)
            outcomes[name] = (strict, _plain(partial))
        assert outcomes["tiercache"] == outcomes["filesystem"]
        assert outcomes["tiercache"][0][0] == "raised"
        assert outcomes["tiercache"][1] == _plain({"a": torch.ones(3), "b": torch.zeros(2)})


def test_a_wrong_shape_fails_alike(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "cache")}}) as cache:
        outcomes = {}
        for name, (writer, reader) in _storages(tmp_path, cache, 1).items():
            dcp.save({"a": torch.ones(3, 4)}, storage_writer=writer, no_dist=True)
            outcomes[name] = _outcome(lambda reader=reader: dcp.load({"a": torch.zeros(4, 3)}, storage_reader=reader(),
                                                                     no_dist=True))
        assert outcomes["tiercache"] == outcomes["filesystem"] and outcomes["tiercache"][0] == "raised"
