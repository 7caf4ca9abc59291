"""Deferred copies: ``save(..., optimizer=opt)`` returns before copying what ``opt.step()`` changes.

In a training step the optimizer's parameters and its state (Adam's moments, step counters)
change only inside ``optimizer.step()``; the forward and backward passes read them. So a save
made right after a step may copy those tensors while the next forward and backward run, as long
as the next ``step()`` waits for the copy (CheckFreq's snapshot overlap). Everything else in the
state (buffers such as BatchNorm's running statistics, which the forward pass changes, copies
made by ``state_dict()``, plain values) is copied before ``save()`` returns, as always.

A tensor of the state is deferred only if its bytes lie inside one of the optimizer's tensors
(``state_dict()`` returns detached views of the parameters, so those match); anything else is
copied at once. Only CPU tensors are deferred: a state on the GPU is copied to the host on a
side stream before ``save()`` returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from tiercache.errors import InvalidArgumentError

#: Start address -> end address of each CPU tensor an optimizer updates in ``step()``.
Owned = dict[int, int]


def owned_by(optimizer: torch.optim.Optimizer) -> Owned:
    """The address ranges of ``optimizer``'s CPU parameters and state tensors.

    Raises:
        InvalidArgumentError: If ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: pass the optimizer "
            "whose step() changes the saved parameters"
        )
    owned: Owned = {}

    def add(t: object) -> None:
        span = _span(t)
        if span is not None:
            owned[span[0]] = max(owned.get(span[0], 0), span[1])

    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
    for per_param in optimizer.state.values():
        if isinstance(per_param, Mapping):  # torch's optimizers keep a dict per parameter
            for v in per_param.values():
                add(v)
    return owned


def deferrable(tensors: Sequence[torch.Tensor], owned: Owned) -> frozenset[int]:
    """Indices of ``tensors`` whose bytes lie inside one of the ``owned`` ranges."""
    out = []
    for i, t in enumerate(tensors):
        span = _span(t)
        if span is not None and span[1] <= owned.get(span[0], 0):
            out.append(i)
    return frozenset(out)


def _span(t: object) -> tuple[int, int] | None:
    """The byte range of a non-empty contiguous CPU tensor (``None`` for anything else)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous() or not t.numel():
        return None
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class StepGuards:
    """Step pre-hooks that make each registered optimizer's ``step()`` wait for deferred copies.

    Args:
        wait: Blocks until every deferred copy started so far is done (never raises: a failed
            copy is reported on its handle and by the next ``save()``/``close()``).
    """

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for the deferred copies (once per optimizer)."""
        if optimizer not in self._hooks:
            wait = self._wait
            self._hooks[optimizer] = optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: wait())

    def close(self) -> None:
        """Remove every hook (the cache is closed: nothing of it is pending any more)."""
        for hook in list(self._hooks.values()):
            hook.remove()
        self._hooks.clear()
