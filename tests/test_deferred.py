"""save(..., optimizer=opt): the optimizer's tensors are copied after save() returns, before opt.step()."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tiercache
from tiercache.cache import core_of
from tiercache.errors import InvalidArgumentError
from tiercache.format import flatten
from tiercache.pipeline.deferred import deferrable, owned_by
from tiercache.pipeline.staging import Stager


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _snapshot(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t.clone() for t in flatten(state).tensors]


def _same(got: dict[str, Any], want: list[torch.Tensor]) -> bool:
    tensors = flatten(got).tensors
    return len(tensors) == len(want) and all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True))


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[tiercache.TierCache]:
    cfg = {"ram": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "disk")}, "policy": {"name": "write-through"},
           "pack_below": "64KiB"}
    with tiercache.open(cfg) as c:
        yield c


@pytest.fixture
def held(cache: tiercache.TierCache) -> Iterator[threading.Event]:
    """Holds the cache's deferred copies back until the test sets the event."""
    gate = threading.Event()
    cache.engine._stager._later.submit(gate.wait)
    yield gate
    gate.set()


def test_only_the_optimizers_parameters_and_state_are_deferred() -> None:
    model, opt = _model()
    _train_step(model, opt)  # Adam makes its moments at the first step
    state = _state(model, opt)
    state["copy"] = model[0].weight.detach().clone()
    state["row"] = model[0].weight.detach()[0]  # inside a parameter, starting where it starts
    flat = flatten(state)
    later = deferrable(flat.tensors, owned_by(opt))
    got = sorted(flat.metas[i].path for i in later)
    params = [f"model/{n}" for n in ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias")]
    moments = [f"optim/state/{i}/{k}" for i in range(6) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert got == sorted([*params, *moments, "row"])


def test_the_version_holds_the_values_at_the_call_and_step_waits_for_the_copy(
    cache: tiercache.TierCache, held: threading.Event
) -> None:
    model, opt = _model()
    _train_step(model, opt)
    state = _state(model, opt)
    want = _snapshot(state)
    handle = cache.save(state, step=1, optimizer=opt)
    assert not handle.future("staged").done()  # the optimizer's tensors are not copied yet
    model.train()
    model(torch.randn(16, 64)).sum().backward()  # forward changes BatchNorm's running statistics
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.3)  # step() waits for the deferred copy
    held.set()
    stepper.join(30)
    assert stepped.is_set()
    assert handle.wait("local", timeout=30) == handle.version
    assert handle.succeeded("staged")
    assert _same(cache.restore(handle.version), want)
    assert not _same(_state(model, opt), want)  # the step and the forward did change them


def test_restore_into_the_saved_tensors_waits_for_the_deferred_copy(
    cache: tiercache.TierCache, held: threading.Event
) -> None:
    model, opt = _model()
    _train_step(model, opt)
    old = cache.save(_state(model, opt), step=1)
    old.wait("staged")
    _train_step(model, opt)
    state = _state(model, opt)
    want = _snapshot(state)
    # restore() itself resolves the ref after every staged version is published, so the direct
    # call is the one that must wait.
    manifest = cache.manifest(old.version)
    new = cache.save(state, step=2, optimizer=opt)
    restorer = threading.Thread(target=core_of(cache).restore_version, args=(manifest,),
                                kwargs={"into": _state(model, opt)})
    restorer.start()
    restorer.join(0.3)
    assert restorer.is_alive()  # it waits: the copy still has to read these tensors
    held.set()
    restorer.join(30)
    assert _same(cache.restore(new.version), want)


def test_a_failed_deferred_copy_fails_its_version_and_is_reported_by_flush(
    cache: tiercache.TierCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    _train_step(model, opt)
    real = Stager._copy_cpu

    def broken(self: Stager, *args: Any, caller: bool) -> None:
        if not caller:
            raise MemoryError("deferred copy lost")
        real(self, *args, caller=caller)

    monkeypatch.setattr(Stager, "_copy_cpu", broken)
    handle = cache.save(_state(model, opt), step=1, optimizer=opt)
    _train_step(model, opt)  # the hook waits for the failed copy and lets training go on
    with pytest.raises(MemoryError, match="deferred copy lost"):
        handle.wait("staged", timeout=30)
    with pytest.raises(MemoryError, match="deferred copy lost"):
        handle.wait("local", timeout=30)
    monkeypatch.setattr(Stager, "_copy_cpu", real)
    again = cache.save(_state(model, opt), step=2, optimizer=opt)  # on_error="warn": training goes on
    assert again.wait("local", timeout=30) == again.version
    with pytest.raises(MemoryError, match="deferred copy lost"):
        cache.flush()  # the lost version is reported once, here
    assert [(v.id, v.parent) for v in cache.versions() if v.tiers != ("ram",)] == [(again.version, None)]


def test_bad_optimizer_arguments_are_refused_before_anything_is_staged(cache: tiercache.TierCache) -> None:
    model, opt = _model()
    with pytest.raises(InvalidArgumentError, match=r"optimizer must be a torch\.optim\.Optimizer, got Sequential"):
        cache.save(_state(model, opt), step=1, optimizer=model)  # type: ignore[arg-type]
    # (With group=, optimizer= is refused in the group's first exchange, on every rank alike: see
    # tests/test_group_faults.py.)
    assert cache.versions() == []


def test_close_removes_the_step_hook(tmp_path: Path) -> None:
    model, opt = _model()
    with tiercache.open({"ram": {"capacity": "64MiB"}}) as c:
        c.save(_state(model, opt), step=1, optimizer=opt)
        c.save(_state(model, opt), step=2, optimizer=opt)
        assert len(opt._optimizer_step_pre_hooks) == 1  # one hook per optimizer and cache
    assert len(opt._optimizer_step_pre_hooks) == 0
    _train_step(model, opt)
