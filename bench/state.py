"""The synthetic training state every benchmark row saves and restores.

It has the shape of ``{"model": model.state_dict(), "optim": adam.state_dict(), "step": N}``:
fp32 parameters, Adam's ``exp_avg`` and ``exp_avg_sq`` per parameter, a 0-d ``step`` tensor per
parameter, and ``param_groups`` with the plain Python leaves torch puts there. The byte mix is
what a transformer checkpoint looks like: a few big matrices hold ~90% of the bytes, and many
small vectors (biases, norms) make up the count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

# Share of the parameter bytes held by the big matrices; the rest is spread over small vectors.
_BIG_SHARE = 0.9
_N_BIG = 6
_N_SMALL = 240
_SMALL_MIN_ELEMS = 256
_MAX_COLS = 4096


def _param_shapes(param_elems: int) -> list[tuple[int, ...]]:
    """Split ``param_elems`` fp32 elements into a few big 2-D shapes and many small 1-D ones."""
    big_each = int(param_elems * _BIG_SHARE) // _N_BIG
    cols = min(_MAX_COLS, max(1, big_each))
    shapes: list[tuple[int, ...]] = [(max(1, big_each // cols), cols) for _ in range(_N_BIG)]
    left = param_elems - sum(r * c for r, c in shapes)
    # Sizes 1x..4x of a base size, so the small tensors are not all the same length.
    weights = [1 + (i % 4) for i in range(_N_SMALL)]
    base = max(_SMALL_MIN_ELEMS, left // sum(weights))
    shapes += [(base * w,) for w in weights]
    return shapes


def make_state(total_bytes: int, *, seed: int = 0) -> dict[str, Any]:
    """Build a model + Adam state dict of about ``total_bytes`` bytes of tensor data.

    Args:
        total_bytes: Target size of all tensors together (params + two moments, step tensors).
        seed: Seed of the generator that fills the tensors, so every run saves the same bytes.

    Returns:
        ``{"model": {...}, "optim": {"state": {i: {...}}, "param_groups": [...]}, "step": int}``.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = _param_shapes(total_bytes // (3 * 4))
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, shape in enumerate(shapes):
        kind = "weight" if len(shape) == 2 else "bias"
        p = torch.randn(shape, generator=gen) * 0.02
        model[f"layers.{i}.{kind}"] = p
        optim_state[i] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(shape, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-6,
        }
    param_groups = [{
        "lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
        "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
        "fused": None, "params": list(range(len(shapes))),
    }]
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups}, "step": 1}


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in a nested dict/list/tuple, depth first in insertion order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from iter_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from iter_tensors(v)


def state_nbytes(tree: Any) -> int:
    """Total bytes of tensor data in ``tree``."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(tree))


def state_summary(tree: Any) -> str:
    """One line describing the tensor mix, for the report header."""
    sizes = sorted((t.numel() * t.element_size() for t in iter_tensors(tree)), reverse=True)
    big = sum(1 for s in sizes if s >= 1 << 20)
    return (f"{len(sizes)} tensors, {state_nbytes(tree) / 1e9:.2f} GB: {big} of >= 1 MiB "
            f"holding {sum(s for s in sizes if s >= 1 << 20) / max(1, sum(sizes)):.0%} of the bytes, "
            f"largest {sizes[0] / 1e6:.0f} MB")


def advance(tree: dict[str, Any]) -> None:
    """Change every tensor in place, as one optimizer step would.

    Saving the same bytes twice would let a content-addressed store skip the second write, so
    benchmarks call this between saves to measure the cost of a real new checkpoint.
    """
    tree["step"] += 1
    for t in iter_tensors(tree):
        t.add_(1.0 if t.dim() == 0 else 1e-7)
