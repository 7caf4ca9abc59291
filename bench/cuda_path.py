"""``python -m bench.cuda_path``: tiercache's CUDA path, timed and checked on a real GPU.

Needs a CUDA device (``--device cpu`` runs the same steps on CPU tensors, as a dry run of the
script; its figures say nothing about the GPU path). On one state of CUDA tensors (fp32 master
weights and Adam moments, bf16 working weights, one transposed view, Adam's 0-d ``step`` tensors
left on the CPU as torch keeps them), it:

1. times the wait inside ``save()`` (a RAM + disk cache: the arena is page-locked with
   ``cudaHostRegister`` and the tensors are copied on a side stream) against a plain device-to-host
   copy of the same tensors into one pinned buffer (``non_blocking`` on a side stream, synchronised
   once) and into one pre-faulted pageable buffer, the three alternated in each round;
2. checks bit for bit the state restored from RAM into the existing CUDA tensors (``into=``), into
   new ones (``map_location="cuda"``) and into new CPU tensors, alternated with host-to-device
   copies of the same bytes from the pinned and the pageable buffer, then, with the cache reopened
   on its disk alone, the version on disk the same three ways;
3. times ``torch.distributed.checkpoint.async_save`` of the same state (what training waits, and
   until durable), and, unless ``--no-agent``, a save through the node agent (its shared arena,
   page-locked in the trainer) with the restore from node RAM checked bit for bit.

Prints a table and writes ``cuda_path.json`` to ``--out`` (default ``$OUT`` or ``bench/out``).
A restore that returns other bytes than were saved makes the run exit 1.

Example::

    python -m bench.cuda_path --size 2GB --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import tiercache
from bench.state import make_state
from tiercache.config import parse_size

_MIB = 1 << 20


class _Warnings(logging.Handler):
    """Keeps every warning tiercache logs (a refused ``cudaHostRegister`` shows up here)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _tensors(state: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list state, with its key path, in a fixed order."""
    if isinstance(state, torch.Tensor):
        yield "", state
    elif isinstance(state, dict):
        for k, v in state.items():
            for p, t in _tensors(v):
                yield f"{k}/{p}" if p else str(k), t
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            for p, t in _tensors(v):
                yield f"{i}/{p}" if p else str(i), t


def make_gpu_state(total_bytes: int, device: str) -> dict[str, Any]:
    """A mixed-precision training state of about ``total_bytes`` on ``device``.

    Three quarters: fp32 parameters + Adam moments (:func:`bench.state.make_state`, its 0-d
    ``step`` tensors kept on the CPU as Adam keeps them); one quarter-ish: bf16 copies of the
    parameters (the working weights), one of them stored transposed (a non-contiguous tensor).
    """
    fp32 = make_state(total_bytes * 6 // 7)
    on = torch.device(device)

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x if x.dim() == 0 else x.to(on)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        return x

    state = move(fp32)
    bf16 = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}
    big = next(k for k, v in bf16.items() if v.dim() == 2)
    bf16[big] = bf16[big].t().contiguous().t()  # same values, column-major: not contiguous
    state["bf16"] = bf16
    return state


def _device_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors :func:`make_gpu_state` put on the device (all but the 0-d ``step`` tensors)."""
    return [t for _, t in _tensors(state) if t.dim() > 0]


def advance(state: dict[str, Any]) -> None:
    """Change every device tensor (so no chunk deduplicates against the last save) and the step."""
    with torch.no_grad():
        ts = _device_tensors(state)
        torch._foreach_add_(ts, 1.0)
    state["step"] += 1


def nbytes_of(state: Any) -> int:
    """Bytes of tensor data in ``state``."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(state))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_same(got: Any, want: Any, what: str, *, device: str, into: Any = None) -> list[str]:
    """Compare two states bit for bit; return one line per difference (empty: identical).

    With ``into``, also check that every tensor returned is the very tensor of ``into``.
    """
    g, w = list(_tensors(got)), list(_tensors(want))
    errors: list[str] = []
    if [k for k, _ in g] != [k for k, _ in w]:
        return [f"{what}: other keys ({len(g)} tensors vs {len(w)})"]
    targets = dict(_tensors(into)) if into is not None else {}
    for (k, a), (_, b) in zip(g, w, strict=True):
        if a.dtype != b.dtype or a.shape != b.shape:
            errors.append(f"{what}: {k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            continue
        if b.device.type != "cpu" and a.device.type != device:
            errors.append(f"{what}: {k}: restored on {a.device}, not {device}")
        if k in targets and a is not targets[k]:
            errors.append(f"{what}: {k}: not the tensor passed in into=")
        on = b.device
        ab = a.detach().to(on).contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            errors.append(f"{what}: {k}: bytes differ")
    return errors


def empty_like_state(state: Any) -> Any:
    """A state of the same structure whose tensors are zeros of the same dtype, shape, strides and device."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    return state


class HostCopy:
    """A device-to-host copy of a state's tensors into one preallocated host buffer (the baselines)."""

    def __init__(self, state: Any, *, pinned: bool) -> None:
        self.offsets: list[int] = []
        at = 0
        for _, t in _tensors(state):
            self.offsets.append(at)
            at += (t.numel() * t.element_size() + 63) // 64 * 64
        self.buf = torch.empty(at, dtype=torch.uint8, pin_memory=pinned)
        self.buf.fill_(0)  # fault every page in, as the arena is
        self.pinned = pinned

    def __call__(self, state: Any, device: str) -> float:
        """Copy every tensor into the buffer; return the seconds until the bytes are all there."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream() if device == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with torch.no_grad(), ctx:
            for (_, t), at in zip(_tensors(state), self.offsets, strict=True):
                n = t.numel() * t.element_size()
                self.buf[at : at + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=self.pinned)
        if stream is not None:
            stream.synchronize()
        return time.perf_counter() - t0

    def back(self, into: Any, device: str) -> float:
        """Copy the buffer into the tensors of ``into`` (host to device); return the seconds until done."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for (_, t), at in zip(_tensors(into), self.offsets, strict=True):
                n = t.numel() * t.element_size()
                t.copy_(self.buf[at : at + n].view(t.dtype).view(t.shape), non_blocking=self.pinned)
        _sync(device)
        return time.perf_counter() - t0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def to_cpu_new(state: Any) -> float:
    """``tensor.cpu()`` of every tensor (new pageable tensors): what ``torch.save`` of a CUDA state does first."""
    t0 = time.perf_counter()
    out = [t.cpu() for _, t in _tensors(state)]
    del out
    return time.perf_counter() - t0


def _stats(runs: list[float]) -> dict[str, Any]:
    return {"runs": runs, "median": statistics.median(runs) if runs else None,
            "min": min(runs) if runs else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Do every step; return the results (``errors`` lists every check that failed)."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.cuda_path needs a CUDA device (torch.cuda.is_available() is False); "
                         "--device cpu runs a dry run on CPU tensors")
    warned = _Warnings()
    logging.getLogger("tiercache").addHandler(warned)
    work = Path(tempfile.mkdtemp(prefix="tc-cuda-", dir=args.work))
    res: dict[str, Any] = {"device": device, "errors": [], "rows": {}, "notes": []}
    rows: dict[str, dict[str, Any]] = res["rows"]
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        res["gpu"] = f"{p.name}, {p.total_memory // _MIB} MiB, {p.multi_processor_count} SMs"
    res["torch"] = torch.__version__
    res["cuda"] = torch.version.cuda
    res["python"] = platform.python_version()
    res["cpus"] = os.cpu_count()
    t_start = time.perf_counter()
    state = make_gpu_state(parse_size(args.size), device)
    _sync(device)
    nbytes = nbytes_of(state)
    res["state"] = {"bytes": nbytes, "tensors": len(list(_tensors(state))),
                    "device_tensors": len(_device_tensors(state)),
                    "dtypes": sorted({str(t.dtype) for _, t in _tensors(state)})}
    print(f"state: {nbytes / 1e9:.2f} GB in {res['state']['tensors']} tensors "
          f"({res['state']['device_tensors']} on {device}), built in {time.perf_counter() - t_start:.1f} s",
          flush=True)
    try:
        _run_cache(args, state, work, res, rows)
        if not args.no_dcp:
            _run_dcp(state, work, device, rows, res)
        if not args.no_agent:
            _run_agent(args, state, work, res, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        logging.getLogger("tiercache").removeHandler(warned)
    res["warnings"] = warned.lines
    res["seconds"] = time.perf_counter() - t_start
    return res


def _row(rows: dict[str, dict[str, Any]], key: str, label: str, runs: list[float], nbytes: int) -> None:
    rows[key] = {"label": label, "nbytes": nbytes, **_stats(runs)}


def _run_cache(args: argparse.Namespace, state: dict[str, Any], work: Path, res: dict[str, Any],
               rows: dict[str, dict[str, Any]]) -> None:
    device = args.device
    nbytes = nbytes_of(state)
    disk = work / "disk"
    config = {"ram": {"capacity": 5 * nbytes // 2}, "disk": {"path": str(disk)}}
    pinned = HostCopy(state, pinned=True) if device == "cuda" else None
    pageable = HostCopy(state, pinned=False)
    first: list[float] = []
    wait: list[float] = []
    local: list[float] = []
    pin_runs: list[float] = []
    page_runs: list[float] = []
    new_runs: list[float] = []
    version = ""
    with tiercache.open(config) as cache:
        for i in range(args.rounds + 1):
            advance(state)
            # Round 0 also allocates, pre-faults and registers the arena: not paired.
            order = ["save"] + ([] if i == 0 else ["pinned"] * (pinned is not None) + ["pageable", "new"])
            if i % 2 == 0:
                order.reverse()
            for what in order:
                _sync(device)
                if what == "save":
                    t0 = time.perf_counter()
                    h = cache.save(state, step=state["step"])
                    waited = time.perf_counter() - t0
                    h.wait("local")
                    (wait if i else first).append(waited)
                    if i:
                        local.append(time.perf_counter() - t0)
                    version = h.version
                elif what == "pinned" and pinned is not None:
                    pin_runs.append(pinned(state, device))
                elif what == "pageable":
                    page_runs.append(pageable(state, device))
                elif what == "new":
                    new_runs.append(to_cpu_new(state))
            print(f"round {i}: save wait {(first + wait)[-1]:.3f} s"
                  + (f", pinned {pin_runs[-1]:.3f} s" if i and pin_runs else "")
                  + (f", pageable {page_runs[-1]:.3f} s" if i else ""), flush=True)
        _row(rows, "tc.first_save_wait", "tiercache first save(): waits (arena alloc + pin)", first, nbytes)
        _row(rows, "tc.save_wait", "tiercache save(): training waits", wait, nbytes)
        _row(rows, "tc.local", "tiercache save: until on disk", local, nbytes)
        if pinned is not None:
            _row(rows, "d2h.pinned", "D2H copy into one pinned buffer (side stream)", pin_runs, nbytes)
        _row(rows, "d2h.pageable", "D2H copy into one pre-faulted pageable buffer", page_runs, nbytes)
        _row(rows, "d2h.new", "tensor.cpu() of every tensor (new pageable tensors)", new_runs, nbytes)
        baselines = {**({"h2d.pinned": pinned} if pinned is not None else {}), "h2d.pageable": pageable}
        _restores(cache, state, version, "ram", device, res, rows, rounds=2, baselines=baselines)
    del pinned, pageable, baselines
    # Reopened on its disk alone: the version on disk, no RAM copy to read from.
    with tiercache.open({"disk": {"path": str(disk)}}) as cache:
        _restores(cache, state, version, "disk", device, res, rows, rounds=1, baselines={})


_RESTORE_LABELS = {
    "into": "restore from {tier} into existing {device} tensors (into=)",
    "new": "restore from {tier} into new tensors (map_location={device!r})",
    "cpu": "restore from {tier} into new CPU tensors (map_location='cpu')",
    "h2d.pinned": "H2D copy from one pinned buffer into existing tensors",
    "h2d.pageable": "H2D copy from one pageable buffer into existing tensors",
}


def _restores(cache: Any, state: Any, version: str, tier: str, device: str, res: dict[str, Any],
              rows: dict[str, dict[str, Any]], *, rounds: int, baselines: dict[str, HostCopy]) -> None:
    """Restore ``version`` into the existing tensors, into new ones (and new CPU ones), alternated
    with the host-to-device ``baselines``; check every restore of the first round bit for bit."""
    nbytes = nbytes_of(state)
    kinds = ["into", "new", *(["cpu"] if device != "cpu" else []), *baselines]
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    srcs: dict[str, dict[str, int]] = {}
    errs: list[str] = []
    for r in range(rounds):
        for what in kinds if r % 2 == 0 else reversed(kinds):
            target = empty_like_state(state) if what == "into" or what in baselines else None
            _sync(device)
            t0 = time.perf_counter()
            got = None
            if what == "into":
                got = cache.restore(version, into=target, resume=False)
            elif what in ("new", "cpu"):
                got = cache.restore(version, map_location=device if what == "new" else "cpu", resume=False)
            else:
                baselines[what].back(target, device)
            _sync(device)
            runs[what].append(time.perf_counter() - t0)
            if got is not None:
                srcs[what] = dict(cache.last_restore.nbytes)
                if r == 0:
                    errs += check_same(got, state, f"restore from {tier}, {what}", device=device if what != "cpu"
                                       else "cpu", into=target if what == "into" else None)
            del got, target
    for what, took in runs.items():
        key = what if what in baselines else f"restore.{tier}.{what}"
        _row(rows, key, _RESTORE_LABELS[what].format(tier=tier, device=device), took, nbytes)
        if what in srcs:
            rows[key]["read_from"] = srcs[what]
            if tier not in srcs[what]:
                errs.append(f"restore from {tier} ({what}): read from {sorted(srcs[what])}, not {tier}")
    res["errors"] += errs
    print(f"restore from {tier}: {'bit-exact' if not errs else '; '.join(errs[:5])} (read from {srcs.get('into')})",
          flush=True)


def _run_dcp(state: Any, work: Path, device: str, rows: dict[str, dict[str, Any]], res: dict[str, Any]) -> None:
    """``torch.distributed.checkpoint.async_save`` of the same state, single process, two rounds."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    waits: list[float] = []
    durable: list[float] = []
    flat = dict(_tensors(state))  # DCP wants string keys all the way down; same tensors
    try:
        for i in range(2):
            target = work / f"dcp{i}"
            advance(state)
            _sync(device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                fut = dcp.async_save(flat, storage_writer=FileSystemWriter(target, thread_count=4), no_dist=True)
                waits.append(time.perf_counter() - t0)
                fut.result()
                durable.append(time.perf_counter() - t0)
            shutil.rmtree(target, ignore_errors=True)
            print(f"dcp async_save {i}: waits {waits[-1]:.3f} s, durable {durable[-1]:.3f} s", flush=True)
    except Exception as e:  # a baseline that does not run is reported, not fatal
        res["notes"].append(f"DCP async_save failed: {e!r}")
        traceback.print_exc()
        return
    nbytes = nbytes_of(state)
    _row(rows, "dcp.async_wait", "DCP async_save: training waits", waits, nbytes)
    _row(rows, "dcp.async_durable", "DCP async_save: until durable", durable, nbytes)


def _run_agent(args: argparse.Namespace, state: Any, work: Path, res: dict[str, Any],
               rows: dict[str, dict[str, Any]]) -> None:
    """Saves through the node agent (shared arena page-locked in this process); restore from node RAM."""
    device = args.device
    nbytes = nbytes_of(state)
    config = {"ram": {"capacity": 5 * nbytes // 2}, "disk": {"path": str(work / "agent-disk")},
              "agent": {"socket": str(work / "agent.sock"), "shm_dir": args.shm_dir, "idle_exit": 60}}
    waits: list[float] = []
    try:
        with tiercache.open(config) as cache:
            version = ""
            for i in range(3):
                advance(state)
                _sync(device)
                t0 = time.perf_counter()
                h = cache.save(state, step=state["step"])
                waits.append(time.perf_counter() - t0)
                h.wait("local")
                version = h.version
                print(f"agent save {i}: waits {waits[-1]:.3f} s", flush=True)
            into = empty_like_state(state)
            _sync(device)
            t0 = time.perf_counter()
            got = cache.restore(version, into=into, resume=False)
            _sync(device)
            took = time.perf_counter() - t0
            src = dict(cache.last_restore.nbytes)
            errs = check_same(got, state, "agent restore, into=", device=device, into=into)
            res["errors"] += errs
            print(f"agent restore: {'bit-exact' if not errs else '; '.join(errs[:5])} (read from {src})", flush=True)
            _row(rows, "agent.first_save_wait", "agent first save(): waits (arena map + pin)", waits[:1], nbytes)
            _row(rows, "agent.save_wait", "agent save(): training waits", waits[1:], nbytes)
            _row(rows, "agent.restore.into", "agent restore into existing tensors", [took], nbytes)
            rows["agent.restore.into"]["read_from"] = src
            del got, into
        from tiercache.agent.client import call
        from tiercache.config import CacheConfig

        call(CacheConfig.model_validate(config), "stop", within=60)
    except Exception as e:  # reported: the in-process rows above stand on their own
        res["errors"].append(f"agent path failed: {e!r}")
        traceback.print_exc()


def render(res: dict[str, Any]) -> str:
    """The table: each row's median and GB/s, and its ratio to the pinned D2H copy."""
    rows = res["rows"]
    ref = (rows.get("d2h.pinned") or rows.get("d2h.pageable") or {}).get("median")
    lines = [f"{'what':<62} {'median s':>9} {'GB/s':>7} {'x pinned':>8}"]
    for r in rows.values():
        m = r["median"]
        if m is None:
            continue
        gbs = r["nbytes"] / m / 1e9 if m else float("inf")
        ratio = f"{m / ref:8.2f}" if ref else "       -"
        lines.append(f"{r['label']:<62} {m:9.3f} {gbs:7.2f} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the CUDA-path benchmark and checks; exit 1 if any restore was not bit-exact."""
    ap = argparse.ArgumentParser(prog="python -m bench.cuda_path", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2GB", help="bytes of tensor data in the state (default 2GB)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds after the first save (default 5)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run of the script on CPU tensors")
    ap.add_argument("--work", default=None, help="parent of the temporary directory (default: the system's)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="where the agent keeps its arena")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="where cuda_path.json goes")
    ap.add_argument("--no-dcp", action="store_true", help="leave out DCP async_save")
    ap.add_argument("--no-agent", action="store_true", help="leave out the node agent")
    args = ap.parse_args(argv)
    res = run(args)
    res["command"] = "python -m bench.cuda_path " + " ".join(argv if argv is not None else sys.argv[1:])
    print(render(res))
    for w in res["warnings"]:
        print("warning:", w)
    for n in res["notes"]:
        print("note:", n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_path.json").write_text(json.dumps(res, indent=1, default=str))
    if res["errors"]:
        print("FAILED:\n  " + "\n  ".join(res["errors"]))
        return 1
    print(f"all restores bit-exact; {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
