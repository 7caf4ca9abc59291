"""The tiercache rows: save wait, time to local and remote, restores per tier, peak RSS, a training loop."""

from __future__ import annotations

import gc
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import tiercache
from bench.baselines import (
    S3Endpoint,
    drop_page_cache,
    memcpy,
    odirect_read,
    odirect_write,
    settle_memory,
    torch_load,
    torch_save,
)
from bench.report import Row, progress
from bench.state import advance, iter_tensors, state_nbytes

TIERCACHE_GROUPS = ("save", "restore", "rss", "loop")

_MIB = 1 << 20
_RSS_SAVES = 10
_RSS_INTERVAL_S = 0.002
_LOOP_STEPS = 10
#: Saves paired with a raw write for the time to local: the disk drifts, so at least this many
#: pairs (two seconds each at 2 GB) whatever ``--repeat`` says.
_LOCAL_PAIRS = 5
_LOOP_WIDTH = 2048
_LOOP_BATCH = 64


def ram_capacity(nbytes: int) -> int:
    """The arena size the bench configures: two versions of the state plus half a version.

    The headroom is what a user would leave; with exactly two versions (+64 MiB) a 2 GB state
    made the third save fail with TierFullError, because the engine reserves room for a
    version's chunks but then also puts its manifest (~180 KB here) into the full arena.
    """
    return 5 * nbytes // 2


def cache_config(root: Path, name: str, capacity: int, s3: S3Endpoint | None, policy: str) -> dict[str, Any]:
    """A RAM + disk (+ S3) config whose disk directory and S3 prefix are both named ``name``."""
    cfg: dict[str, Any] = {
        "ram": {"capacity": capacity},
        "disk": {"path": str(root / name)},
        "policy": {"name": policy},
    }
    if s3 is not None:
        cfg["s3"] = {"url": f"s3://{s3.bucket}/{name}", "endpoint_url": s3.endpoint_url,
                     "part_size": s3.part_size, "max_concurrency": s3.concurrency}
    return cfg


def _check_same(restored: Any, state: Any, what: str) -> None:
    """Refuse to report the speed of a restore that returned other bytes than were saved."""
    got, want = list(iter_tensors(restored)), list(iter_tensors(state))
    if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise RuntimeError(f"{what} returned different tensors than were saved")


def _tiers_of(cache: Any, version: str) -> tuple[str, ...]:
    return next(v.tiers for v in cache.versions() if v.id == version)


def _evict(cache: Any, version: str, tiers: Sequence[str]) -> None:
    """Drop ``version`` from ``tiers`` where it is (a restore may have promoted it back)."""
    held = _tiers_of(cache, version)
    for tier in tiers:
        if tier in held:
            cache.evict(version, tier)


def _run_save(cache: Any, state: dict[str, Any], repeat: int, with_s3: bool,
              raw: Path | None = None) -> tuple[list[Row], str]:
    """Time ``save()`` and its ``local`` and ``remote`` futures; return the rows and the last version.

    With ``raw`` (a file path on the disk tier's filesystem), every timed save is paired with a raw
    O_DIRECT write of the same bytes to ``raw``, before the save in odd runs and after it in even
    ones, and at least ``_LOCAL_PAIRS`` saves are timed: this virtual disk switches between two
    write speeds within minutes, so the time to local is compared with raw writes that saw the
    same disk.
    """
    nbytes = state_nbytes(state)
    if raw is not None:
        repeat = max(repeat, _LOCAL_PAIRS)
    paired = Row("odirect.write_paired", "O_DIRECT write + fsync, paired with the saves", "limit",
                 nbytes=nbytes)

    def raw_write() -> None:
        assert raw is not None
        paired.runs.append(odirect_write(raw, nbytes))
        raw.unlink()

    first = Row("tc.first_save_wait", "tiercache first save(): waits (arena allocation)", "tiercache",
                nbytes=nbytes)
    wait = Row("tc.save_wait", "tiercache save(): training waits", "tiercache", nbytes=nbytes)
    local = Row("tc.local", "tiercache save: until local (disk)", "tiercache", nbytes=nbytes)
    remote = Row("tc.remote", "tiercache save: until remote (S3)", "tiercache", nbytes=nbytes)
    version = ""
    for i in range(repeat + 1):
        if raw is not None and i % 2 == 1:  # run 0 (the first save) is not paired
            raw_write()
        advance(state)
        t0 = time.perf_counter()
        h = cache.save(state, step=state["step"], meta={"bench_run": i})
        waited = time.perf_counter() - t0
        h.wait("local")
        to_local = time.perf_counter() - t0
        to_remote = 0.0
        if with_s3:
            h.wait("remote")
            to_remote = time.perf_counter() - t0
        version = h.version
        if i == 0:
            # The first save also allocates and pre-faults the arena: shown on its own row.
            first.runs.append(waited)
            continue
        wait.runs.append(waited)
        local.runs.append(to_local)
        remote.runs.append(to_remote)
        if raw is not None and i > 0 and i % 2 == 0:
            raw_write()
    return [first, wait, local, *([remote] if with_s3 else []), *([paired] if raw else [])], version


def _prefaulted_like(state: Any) -> Any:
    """A tree shaped like ``state`` whose tensors are new, already-touched buffers (for ``into=``)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state).fill_(1)
    if isinstance(state, dict):
        return {k: _prefaulted_like(v) for k, v in state.items()}
    return state


def _run_restore(cache: Any, state: dict[str, Any], version: str, repeat: int, disk_root: Path,
                 with_s3: bool) -> list[Row]:
    """Restore ``version`` from RAM (into existing tensors), from a cold disk, and from S3 alone.

    Every restore is paired with its baseline, run just before it on the same machine state:
    a memcpy of the state before each restore from RAM (the memory bandwidth drifts: the RAM
    restore measured 1.0-1.5x the memcpy row of the same run, taken minutes earlier), a cold
    ``torch.load`` before each cold restore into new tensors, and a raw O_DIRECT read of the same
    bytes before each cold restore into existing tensors. Every cold read, baseline or not, starts
    with the page cache dropped and freed memory back with the host (see ``settle_memory``).
    """
    nbytes = state_nbytes(state)
    torch_file = disk_root.parent / "torch-paired.pt"  # beside the disk tier's directory, not in it
    raw_file = disk_root.parent / "raw-paired.bin"
    torch_save(state, torch_file)
    odirect_write(raw_file, nbytes)
    load_paired = Row("torch.load_cold_paired", "torch.load, cold, freed memory back with the host",
                      "baseline", nbytes=nbytes)
    read_paired = Row("odirect.read_paired", "O_DIRECT read, cold, freed memory back with the host",
                      "limit", nbytes=nbytes)
    memcpy_paired = Row("memcpy_paired", "memcpy into pre-faulted buffers, alternating with RAM restores",
                        "limit", nbytes=nbytes)
    settled: list[float] = []

    def cold_start(row: Row, path: Path) -> None:
        row.note = drop_page_cache(path)
        settled.append(settle_memory())

    def paired_memcpy() -> None:
        memcpy_paired.runs.append(memcpy(state))

    def paired_load() -> None:
        cold_start(load_paired, torch_file)
        load_paired.runs.append(torch_load(torch_file))

    def paired_read() -> None:
        cold_start(read_paired, raw_file)
        read_paired.runs.append(odirect_read(raw_file))

    def timed(row: Row, what: str, evict: Sequence[str], into: Any, pair: Callable[[], None] | None,
              cold: bool, runs: int = repeat) -> Row:
        # Each run drops the version from ``evict`` (a restore may promote it back), times its
        # paired baseline and, for a cold read, starts cold; the first run's result is checked
        # bit-exact.
        for i in range(runs):
            _evict(cache, version, evict)
            if pair is not None:
                pair()
            if cold:
                cold_start(row, disk_root)
            t0 = time.perf_counter()
            out = cache.restore(version, into=into)
            row.runs.append(time.perf_counter() - t0)
            if i == 0:
                _check_same(out, state, what)
            del out
        gc.collect()
        return row

    ram = Row("tc.restore_ram", "tiercache restore from RAM (into=)", "tiercache", nbytes=nbytes)
    if "ram" not in _tiers_of(cache, version):
        ram.note = f"not held in RAM (tiers: {', '.join(_tiers_of(cache, version))})"
    rows = [
        # A 2 GB restore from RAM takes ~0.2 s: at least as many pairs as the time to local.
        timed(ram, "restore from RAM", [], _prefaulted_like(state), paired_memcpy, False,
              max(repeat, _LOCAL_PAIRS)),
        timed(Row("tc.restore_disk", "tiercache restore from disk (cold)", "tiercache", nbytes=nbytes),
              "restore from disk", ["ram"], None, paired_load, True),
        # The usual resume: the model and optimizer exist, so their tensors are already touched
        # and the bytes land in them in place (no allocation, no page faults).
        timed(Row("tc.restore_disk_into", "tiercache restore from disk (cold) into existing tensors",
                  "tiercache", nbytes=nbytes),
              "restore from disk into existing tensors", ["ram"], _prefaulted_like(state), paired_read, True),
    ]
    torch_file.unlink()
    raw_file.unlink()
    if settled:
        waited = f"waited {min(settled):.0f}-{max(settled):.0f} s for freed memory to go back"
        for row in (load_paired, read_paired, *rows[1:]):
            row.note = f"{row.note}; {waited}" if row.note else waited
    if with_s3:
        rows.append(timed(Row("tc.restore_s3", "tiercache restore from S3 only", "tiercache", nbytes=nbytes),
                          "restore from S3", ["ram", "disk"], None, None, False))
    return [memcpy_paired, load_paired, read_paired, *rows]


@contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """Sample this process's RSS on a thread; the yielded list holds the peak when the block ends."""
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(_RSS_INTERVAL_S)

    thread = threading.Thread(target=sample, name="bench-rss", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        peak[0] = max(peak[0], proc.memory_info().rss)


def _run_rss(config: dict[str, Any], state: dict[str, Any], capacity: int) -> list[Row]:
    """Peak RSS while 10 saves run back to back (each a new version) and ``close()`` drains them."""
    gc.collect()
    before = psutil.Process().memory_info().rss
    waits: list[float] = []
    with _peak_rss() as peak:
        t0 = time.perf_counter()
        with tiercache.open(config) as cache:
            for _ in range(_RSS_SAVES):
                advance(state)
                t1 = time.perf_counter()
                cache.save(state, step=state["step"])
                waits.append(time.perf_counter() - t1)
        total = time.perf_counter() - t0
    budget = before + int(capacity * 1.05)
    note = (f"RAM + disk; {_RSS_SAVES} saves + close in {total:.1f} s; "
            f"save waits {min(waits):.3f}-{max(waits):.3f} s; "
            f"peak - RSS before open = {(peak[0] - before) / 1e9:.2f} GB")
    return [
        Row("tc.rss_peak", "tiercache peak RSS, 10 back-to-back saves", "tiercache",
            runs=[peak[0] / 1e9], unit="GB", note=note),
        Row("tc.rss_budget", "RSS budget: RSS before open + capacity x1.05", "limit",
            runs=[budget / 1e9], unit="GB",
            note=f"capacity {capacity / 1e9:.2f} GB; the state is in the RSS before open"),
    ]


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(_LOOP_WIDTH // 2, _LOOP_WIDTH), nn.ReLU(),
                          nn.Linear(_LOOP_WIDTH, _LOOP_WIDTH), nn.ReLU(),
                          nn.Linear(_LOOP_WIDTH, _LOOP_WIDTH // 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


class _Loop:
    """An MLP training loop that can checkpoint after every step without waiting for durability."""

    def __init__(self) -> None:
        self.model, self.opt = _mlp()
        self.x = torch.randn(_LOOP_BATCH, _LOOP_WIDTH // 2)
        self.y = torch.randn(_LOOP_BATCH, _LOOP_WIDTH // 2)
        self.step = 0
        self.state: dict[str, Any] = {}

    def run(self, steps: int, cache: Any | None, *, defer: bool = False) -> tuple[float, float]:
        """Run ``steps`` steps (saving each one to ``cache`` if given).

        ``defer``: save with ``optimizer=`` (the optimizer's tensors are copied during the next
        forward and backward; ``step()`` waits for that copy, which is charged to the step).

        Returns:
            (seconds per step, seconds per step spent inside ``save()``).
        """
        in_save = 0.0
        optimizer = self.opt if defer else None
        t0 = time.perf_counter()
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(self.model(self.x), self.y).backward()
            self.opt.step()
            self.step += 1
            self.state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}
            if cache is not None:
                t1 = time.perf_counter()
                cache.save(self.state, step=self.step, optimizer=optimizer)
                in_save += time.perf_counter() - t1
        return (time.perf_counter() - t0) / steps, in_save / steps


def _run_loop(config: dict[str, Any], repeat: int) -> list[Row]:
    """Per-step slowdown of a 1-thread CPU training loop that checkpoints every step.

    The step time of this loop drifts by more than the effect measured (page faults, a shared
    host), so plain and checkpointing steps are timed in alternating blocks of the same run and
    the slowdown is the median of the block-to-block differences: each checkpointing block (plain
    ``save()``, then ``save(optimizer=)``) is compared with the plain block before it. Each
    checkpointing block starts after one untimed save (so it carries the background work of a
    save before it, as in steady state) and each plain block after a flush and one untimed step
    (so none of it spills over).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = Row("loop.plain", "MLP loop step, no checkpoint", "baseline")
        ckpt = Row("loop.ckpt", "MLP loop step, tiercache save every step", "tiercache")
        deferred = Row("loop.ckpt_deferred", "MLP loop step, tiercache save(optimizer=) every step", "tiercache")
        in_save: dict[bool, list[float]] = {False: [], True: []}
        slowdowns: dict[bool, list[float]] = {False: [], True: []}
        loop = _Loop()
        blocks = max(8, 4 * repeat)
        with tiercache.open(config) as cache:
            loop.run(1, cache)  # Adam creates its moments lazily, and the arena is allocated once
            for b in range(2 * blocks):
                defer = b % 2 == 1
                cache.flush()
                loop.run(1, None)
                base = loop.run(_LOOP_STEPS, None)[0]
                plain.runs.append(base)
                loop.run(1, cache, defer=defer)
                per_step, waited = loop.run(_LOOP_STEPS, cache, defer=defer)
                (deferred if defer else ckpt).runs.append(per_step)
                in_save[defer].append(waited)
                slowdowns[defer].append(per_step - base)
        nbytes = state_nbytes(loop.state)
        copy = Row("loop.memcpy", "memcpy of the loop's state", "limit", nbytes=nbytes, note="1 thread, libc memcpy")
        copy.runs = [memcpy(loop.state) for _ in range(max(5, repeat))]
    finally:
        torch.set_num_threads(threads)
    note = f"state {nbytes / 1e6:.0f} MB, {blocks} x 2 blocks of {_LOOP_STEPS} steps, 1 torch thread, RAM + disk only"
    slow = Row("tc.loop_slowdown", "loop slowdown per step from checkpointing", "tiercache", runs=slowdowns[False],
               note=f"{note}; inside save(): {statistics.median(in_save[False]):.3f} s/step")
    slow_deferred = Row("tc.loop_slowdown_deferred", "... with save(optimizer=): copy overlaps forward/backward",
                        "tiercache", runs=slowdowns[True],
                        note=f"{note}; inside save(): {statistics.median(in_save[True]):.3f} s/step")
    return [plain, ckpt, deferred, copy, slow, slow_deferred]


def run_tiercache(state: dict[str, Any], work: Path, *, repeat: int, groups: Sequence[str],
                  s3: S3Endpoint | None, policy: str) -> list[Row]:
    """Measure the selected tiercache groups (see ``TIERCACHE_GROUPS``) on ``state``.

    Each group opens its own cache on a fresh directory and S3 prefix and closes it; ``restore``
    reuses the versions ``save`` wrote (and saves them first when run alone).

    Args:
        state: The state dict to save; changed in place between saves (see ``advance``).
        work: Scratch directory on the filesystem under test.
        repeat: Runs per row.
        groups: Which groups to run.
        s3: The S3 endpoint, or ``None`` for a RAM + disk cache.
        policy: Policy name for the caches.

    Returns:
        The rows, in group order.
    """
    rows: list[Row] = []
    capacity = ram_capacity(state_nbytes(state))
    root = work / "tiercache"
    if "save" in groups or "restore" in groups:
        progress("tiercache save" + (" + restore" if "restore" in groups else ""))
        if s3 is not None and "save" in groups:
            # The wait and the time to local are measured without S3: the local S3 server shares
            # this machine's 2 cores and disk, and after each upload it keeps flushing, which
            # would be charged to the next save (a real object store is elsewhere). The S3 run
            # below then measures the time to remote.
            with tiercache.open(cache_config(root, "save-local", capacity, None, policy)) as cache:
                local_rows, _ = _run_save(cache, state, repeat, False, root / "raw-paired.bin")
            _drop(root / "save-local")
        config = cache_config(root, "save", capacity, s3, policy)
        gc.collect()
        before = psutil.Process().memory_info().rss
        with tiercache.open(config) as cache:
            with _peak_rss() as peak:
                raw = root / "raw-paired.bin" if s3 is None and "save" in groups else None
                saved, version = _run_save(cache, state, repeat, s3 is not None, raw)
            # The rss group leaves S3 out (see there), so the S3 upload buffers are checked here.
            rss_note = (f"peak RSS during saves{' incl. S3' if s3 else ''}: "
                        f"{(peak[0] - before) / 1e9:.2f} GB over RSS before open "
                        f"(capacity {capacity / 1e9:.2f} GB)")
            if s3 is not None and "save" in groups:
                saved = [*local_rows[:3], saved[3], *local_rows[3:]]
                saved[3].note = rss_note
            else:
                saved[1].note = rss_note
            if "save" in groups:
                rows += saved
            if "restore" in groups:
                rows += _run_restore(cache, state, version, repeat, root / "save", s3 is not None)
        _drop(root / "save")
    if "rss" in groups:
        progress("rss")
        # RAM + disk only: with write-through, 10 back-to-back saves would otherwise wait for 10
        # S3 uploads (minutes at 2 GB); the save group above samples RSS with S3 instead.
        rows += _run_rss(cache_config(root, "rss", capacity, None, policy), state, capacity)
        _drop(root / "rss")
    if "loop" in groups:
        progress("loop")
        # The loop's state is small (~100 MB); S3 is left out because write-through would upload
        # every step and the loop would then measure the S3 link, not the cost to training.
        rows += _run_loop(cache_config(root, "loop", 512 * _MIB, None, policy), repeat)
        _drop(root / "loop")
    return rows


def _drop(path: Path) -> None:
    """Free a finished group's memory and disk space (a 2 GB run would otherwise keep ~30 GB)."""
    gc.collect()
    shutil.rmtree(path, ignore_errors=True)
