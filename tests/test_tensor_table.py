"""The tensor table stored as columns: round trips, manifests of the old layout, and restores of many
small tensors (into new tensors, into existing ones, contiguous or not), all bit-exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import tiercache
from tiercache.manifest import Version, unseal
from tiercache.names import version_key
from tiercache.tensor_table import Piece, TensorEntry, TensorTable


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    return {"disk": {"path": str(root)}, "policy": {"name": "write-through"}, **extra}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (compares NaN payloads, -0.0 and bool/complex exactly)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), k


def _mixed_state(n: int) -> dict[str, torch.Tensor]:
    """``n`` small tensors of every kind of dtype and shape, plus a 0-d, an empty and a multi-chunk one."""
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.complex64, torch.bool, torch.int64,
              torch.float16, torch.uint8]
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        shape = [(1 + i % 7, 1 + (i * 13) % 50), [1 + (i * 31) % 300], [2, 3, 1 + i % 4]][i % 3]
        raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dt.itemsize,), dtype=torch.uint8, generator=g)
        state[f"layer{i}/w"] = raw.view(dt).view(shape)
    state["scalar"] = torch.tensor(float("nan"))
    state["empty"] = torch.empty(0, 5)
    state["big"] = torch.randn(300_000, generator=g)  # 1.2 MB: split over two 1 MiB chunks
    return state


def test_table_round_trips_through_its_columns() -> None:
    entries = [
        TensorEntry(path="a/é\nb", dtype="float32", shape=(2, 3), nbytes=24,
                    pieces=(Piece(chunk=0, chunk_offset=8, offset=0, nbytes=24),)),
        TensorEntry(path="", dtype="bool", shape=(), nbytes=1, pieces=(Piece(chunk=1, chunk_offset=0, offset=0,
                                                                             nbytes=1),)),
        TensorEntry(path="empty", dtype="int64", shape=(0, 4), nbytes=0, pieces=()),
        TensorEntry(path="split", dtype="uint8", shape=(70_000,), nbytes=70_000, pieces=(
            Piece(chunk=1, chunk_offset=64, offset=0, nbytes=65_536),
            Piece(chunk=2, chunk_offset=0, offset=65_536, nbytes=4_464))),
    ]
    table = TensorTable.from_entries(entries)
    assert table.check([32, 65_600, 4_464]) == 24 + 1 + 70_000
    again = TensorTable.coerce(json.loads(json.dumps(table.encode())))
    assert again == table
    assert list(again) == entries
    assert again[-1] == entries[-1] and again[1:3] == tuple(entries[1:3])


def test_manifest_stores_columns_and_an_old_layout_manifest_still_restores_bit_exact(tmp_path: Path) -> None:
    state = _mixed_state(400)
    with tiercache.open(_config(tmp_path, chunk_bytes="1MiB", pack_below="64KiB")) as cache:
        cache.save(state, step=7).wait("local")
        version = cache.manifest("main")
    path = tmp_path / version_key(version.id)
    stored = json.loads(unseal(path.read_bytes(), str(path)))
    assert stored["schema_version"] == 2 and stored["tensors"]["columns"] == 1
    assert stored["tensors"]["count"] == len(state) and stored["tensors"]["path"] == list(state)

    # The same manifest as tiercache wrote it before the columns: one object per tensor, schema 1.
    old = dict(stored, schema_version=1, tensors=[json.loads(e.model_dump_json()) for e in version.tensors])
    old_bytes = json.dumps(old).encode()
    assert len(path.read_bytes()) * 2 < len(old_bytes)  # the columns are the smaller form
    path.write_bytes(old_bytes)
    with tiercache.open(_config(tmp_path)) as cache:
        assert cache.manifest("main") == version
        _assert_bit_exact(cache.restore("main"), state)
    assert Version.from_json(old_bytes).to_json() == Version.from_json(version.to_json()).to_json()


def test_many_small_tensors_restore_bit_exact_into_new_existing_and_non_contiguous_tensors(tmp_path: Path) -> None:
    state = _mixed_state(3000)
    with tiercache.open(_config(tmp_path, chunk_bytes="256KiB", pack_below="64KiB")) as cache:
        cache.save(state, step=1).wait("local")
        packs = {p.chunk for e in cache.manifest("main").tensors if len(e.pieces) == 1 for p in e.pieces}
        assert len(packs) >= 3  # the small tensors span several packed chunks
    into: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(state.items()):
        if i % 3 == 0 and v.dim() == 2:  # a transposed view: not contiguous
            into[k] = torch.zeros(v.shape[1], v.shape[0], dtype=v.dtype).t()
            assert not into[k].is_contiguous() or 1 in v.shape
        else:
            into[k] = torch.zeros_like(v)
    ptrs = {k: t.data_ptr() for k, t in into.items()}
    with tiercache.open(_config(tmp_path)) as cache:
        fresh = cache.restore("main")
        existing = cache.restore("main", into=into)
    _assert_bit_exact(fresh, state)
    _assert_bit_exact(existing, state)
    _assert_bit_exact(into, state)
    assert {k: t.data_ptr() for k, t in existing.items()} == ptrs
    # Every new tensor owns its memory: writing one leaves its neighbours as they were.
    fresh["layer1/w"].fill_(0)
    assert torch.equal(_bits(fresh["layer2/w"]), _bits(state["layer2/w"]))
    assert fresh["layer1/w"].untyped_storage().data_ptr() != fresh["layer2/w"].untyped_storage().data_ptr()
