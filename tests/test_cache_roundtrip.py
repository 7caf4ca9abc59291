"""End-to-end round trips of training states through tiercache.open() with a disk tier (and RAM)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_format import DTYPE_NAMES, PLAIN_LEAVES, assert_same, random_tensor

import tiercache
from tiercache.errors import UnsupportedStateError

# Small chunks and a small packing threshold, so that a few hundred KiB of tensors exercise
# multi-chunk tensors, packed chunks and single-tensor chunks alike.
CHUNKING = {"chunk_bytes": "64KiB", "pack_below": "4KiB"}
SETUPS = ["disk", "ram+disk"]


def make_config(root: Path, setup: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"disk": {"path": str(root / "disk")}, **CHUNKING, **extra}
    if setup == "ram+disk":
        config["ram"] = {"capacity": "32MiB"}
    return config


@pytest.fixture(params=SETUPS)
def config(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    return make_config(tmp_path, request.param)


@pytest.fixture
def cache(config: dict[str, Any]) -> Iterator[tiercache.TierCache]:
    with tiercache.open(config) as c:
        yield c


def durable_files(root: Path, kind: str) -> set[str]:
    base = root / kind
    return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()} if base.exists() else set()


def every_dtype_tensors() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(DTYPE_NAMES):
        dtype = getattr(torch, name)
        base = random_tensor(dtype, (6, 5, 4), seed=i)
        out[f"{name}.dense"] = base
        out[f"{name}.scalar"] = random_tensor(dtype, (), seed=100 + i)
        out[f"{name}.empty"] = random_tensor(dtype, (0, 3))
        out[f"{name}.strided"] = base.transpose(0, 2)[::2]
    # Bigger than a chunk: split over several chunks.
    out["large"] = random_tensor(torch.float32, (300, 170), seed=7)
    out["large_bf16"] = random_tensor(torch.bfloat16, (90, 800), seed=8)
    return out


BATCHES = [(torch.randn(8, 6, generator=torch.Generator().manual_seed(s)),
            torch.randn(8, 3, generator=torch.Generator().manual_seed(1000 + s))) for s in range(9)]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
}


def new_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def trained(opt_name: str, steps: int = 3, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cls, kw = OPTIMIZERS[opt_name]
    model = new_model(seed)
    opt = cls(model.parameters(), **kw)
    train(model, opt, BATCHES[:steps])
    return model, opt


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "epoch": 3,
        "tensors": every_dtype_tensors(),
        "leaves": list(PLAIN_LEAVES),
        "nested": {0: (1.5, [torch.arange(5)]), "none": None, "nan": math.nan},
    }


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_state_roundtrips_bit_exact_in_process_and_after_reopen(
    tmp_path: Path, config: dict[str, Any], opt_name: str
) -> None:
    model, opt = trained(opt_name)
    state = training_state(model, opt)
    with tiercache.open(config) as cache:
        handle = cache.save(state, step=3, meta={"loss": 0.5})
        assert handle.wait("local") == handle.version
        assert_same(state, cache.restore("main"))
        assert_same(state, cache.restore(handle.version))
    # A new process sees only what is durable on disk.
    with tiercache.open(make_config(tmp_path, "disk")) as reopened:
        assert [v.id for v in reopened.versions()] == [handle.version]
        assert_same(state, reopened.restore("main"))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_resumed_training_matches_an_uninterrupted_run(cache: tiercache.TierCache, opt_name: str) -> None:
    model, opt = trained(opt_name)
    cache.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=3).wait("local")
    train(model, opt, BATCHES[3:6])  # the uninterrupted run

    restored = cache.restore("main")
    cls, kw = OPTIMIZERS[opt_name]
    resumed = new_model(seed=1)  # other initial weights: all of them must come from the checkpoint
    resumed_opt = cls(resumed.parameters(), **kw)
    resumed.load_state_dict(restored["model"])
    resumed_opt.load_state_dict(restored["optim"])
    train(resumed, resumed_opt, BATCHES[3:6])

    for (name, want), (_, got) in zip(model.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(got, want), name
    assert_same(opt.state_dict(), resumed_opt.state_dict())


def test_restore_into_fills_the_whole_state_in_place(cache: tiercache.TierCache) -> None:
    model, opt = trained("adamw")
    saved = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = {
        "model": {k: v.clone() for k, v in saved["model"].items()},
        "optim": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["optim"]["state"].items()},
    }
    cache.save(saved, step=3).wait("local")

    other, other_opt = trained("adamw", steps=2, seed=5)
    into = {"model": other.state_dict(), "optim": other_opt.state_dict()}
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    opt_ptrs = {(i, n): v.data_ptr() for i, s in into["optim"]["state"].items() for n, v in s.items()}

    out = cache.restore("main", into=into)

    for k, v in into["model"].items():
        assert v.data_ptr() == ptrs[k]
        assert torch.equal(v, expected["model"][k]), k
        assert out["model"][k] is v
    for (i, n), ptr in opt_ptrs.items():
        target = into["optim"]["state"][i][n]
        assert target.data_ptr() == ptr
        assert torch.equal(target, expected["optim"][i][n]), (i, n)
    # The model's own parameters share storage with its state dict, so the model now holds the checkpoint.
    for name, p in other.named_parameters():
        assert torch.equal(p, expected["model"][name]), name


def test_restore_into_part_of_the_state(cache: tiercache.TierCache) -> None:
    weight = torch.randn(4, 6)
    bias = torch.randn(4)
    state = {"model": {"weight": weight, "bias": bias}, "step": 7}
    cache.save(state, step=7).wait("local")

    target = torch.zeros(4, 6)
    backing = torch.zeros(6, 4)
    transposed_target = backing.t()  # non-contiguous: filled through a copy, still in place
    ptr, backing_ptr = target.data_ptr(), backing.data_ptr()

    out = cache.restore("main", into={"model": {"weight": target}})
    assert out["model"]["weight"] is target and target.data_ptr() == ptr
    assert torch.equal(target, weight)
    assert torch.equal(out["model"]["bias"], bias) and out["model"]["bias"].data_ptr() != bias.data_ptr()
    assert out["step"] == 7

    cache.restore("main", into={"model": {"weight": transposed_target}})
    assert backing.data_ptr() == backing_ptr
    assert torch.equal(transposed_target, weight)


def test_mutating_sources_right_after_save_does_not_change_the_version(cache: tiercache.TierCache) -> None:
    state = {"a": torch.randn(300, 200), "small": torch.arange(10), "views": [torch.randn(50, 40).t()]}
    before = {"a": state["a"].clone(), "small": state["small"].clone(), "views": [state["views"][0].clone()]}
    handle = cache.save(state, step=1)
    state["a"].fill_(math.nan)
    state["small"].add_(1)
    state["views"][0].zero_()
    handle.wait("local")
    assert_same(before, cache.restore(handle.version))


def test_unsupported_leaf_is_refused_and_nothing_is_written(
    tmp_path: Path, cache: tiercache.TierCache
) -> None:
    with pytest.raises(UnsupportedStateError, match=r"'optim/extra/1'"):
        cache.save({"w": torch.ones(3), "optim": {"extra": [1, object()]}}, step=1)
    cache.flush()
    assert cache.versions() == []
    assert cache.refs() == {}
    disk = tmp_path / "disk"
    assert durable_files(disk, "chunks") == set()
    assert durable_files(disk, "versions") == set()
    assert durable_files(disk, "refs") <= {".lock"}


def test_saving_the_same_state_twice_adds_no_chunk_files(tmp_path: Path, cache: tiercache.TierCache) -> None:
    model, opt = trained("adamw")
    state = training_state(model, opt)
    first = cache.save(state, step=1)
    first.wait("local")
    chunks = durable_files(tmp_path / "disk", "chunks")
    assert chunks

    second = cache.save(state, step=2)
    second.wait("local")
    assert durable_files(tmp_path / "disk", "chunks") == chunks
    assert [v.id for v in cache.versions()] == [first.version, second.version]
    assert cache.versions()[1].parent == first.version
    assert_same(state, cache.restore(first.version))
    assert_same(state, cache.restore("main"))


def test_pickled_leaf_needs_the_opt_in_to_save_and_to_restore(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0), "seen": {3, 1, 2}}
    with tiercache.open(make_config(tmp_path, "disk", allow_pickle=True)) as cache:
        cache.save(state, step=1).wait("local")
        out = cache.restore("main")
        assert out["seen"] == {1, 2, 3} and torch.equal(out["w"], state["w"])
    with (
        tiercache.open(make_config(tmp_path, "disk")) as cache,
        pytest.raises(UnsupportedStateError, match="allow_pickle = true"),
    ):
        cache.restore("main")
