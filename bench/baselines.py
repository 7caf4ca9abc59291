"""The limits and the baselines tiercache is measured against; each function returns seconds.

Limits: a memcpy into pre-faulted buffers (the RAM tier cannot beat it), allocating and touching
new tensors (what every restore that returns new tensors pays), raw O_DIRECT sequential write +
fsync and read of the same bytes (the disk cannot go faster), a boto3 multipart transfer (the S3
endpoint's speed). Baselines: what a trainer uses today -- ``torch.save``/``torch.load``,
``torch.distributed.checkpoint`` save and async_save, and s3torchconnector's ``S3Checkpoint``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from bench.report import Row, measure, progress, unavailable
from bench.state import iter_tensors, state_nbytes

_ALIGN = 4096
# One O_DIRECT request: large enough that per-call overhead vanishes, small enough to stay in RAM.
_DIRECT_BLOCK = 64 << 20
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# Memory this guest has handed back to its host so far (free page reporting, virtio-balloon);
# a counter of this machine's kernel, absent elsewhere.
_REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def _prefaulted_pairs(state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) for every tensor; destinations are new, already-touched buffers."""
    # fill_ touches every page now, so the timed copy pays no page faults.
    return [(t, torch.empty_like(t).fill_(1)) for t in iter_tensors(state)]


def memcpy(state: Any) -> float:
    """libc memcpy of every tensor of ``state`` into pre-faulted buffers: the RAM-tier limit."""
    pairs = _prefaulted_pairs(state)
    t0 = time.perf_counter()
    for src, dst in pairs:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - t0


def torch_copy(state: Any) -> float:
    """``Tensor.copy_`` of every tensor into pre-faulted buffers, with torch's intra-op threads.

    Shown next to :func:`memcpy` because on a small, shared machine the thread pool's wake-ups
    can make ``copy_`` of MiB-sized tensors several times slower than one plain memcpy.
    """
    pairs = _prefaulted_pairs(state)
    t0 = time.perf_counter()
    for src, dst in pairs:
        dst.copy_(src)
    return time.perf_counter() - t0


def fault_in(state: Any) -> float:
    """Allocate new tensors shaped like ``state`` and touch every page: what any restore that
    returns new tensors (``torch.load``, ``restore()`` without ``into=``) pays before its I/O.
    """
    t0 = time.perf_counter()
    fresh = [torch.empty_like(t).fill_(0) for t in iter_tensors(state)]
    elapsed = time.perf_counter() - t0
    del fresh
    return elapsed


@functools.lru_cache(maxsize=1)
def _aligned_source(nbytes: int) -> mmap.mmap:
    """A page-aligned, pre-faulted buffer of ``nbytes`` for O_DIRECT, made once per size.

    Every request reads or writes its own part of it, as a checkpoint's bytes would: on this
    VM, O_DIRECT through one 64 MiB buffer reused for every request measured 1.5x slower than
    through distinct memory (2 GB, alternating: writes 0.95 s against 0.65 s, reads 0.62 s
    against 0.38 s), which made the disk limits look lower than they are.
    """
    buf = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, _DIRECT_BLOCK):
        n = min(_DIRECT_BLOCK, nbytes - off)
        buf[off : off + n] = b"\xa5" * n  # anonymous mmaps start on a page; writing faults every page in
    return buf


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def odirect_write(path: Path, nbytes: int) -> float:
    """Write ``nbytes`` (rounded up to 4 KiB) to a new file with O_DIRECT, then fsync it."""
    total = _round_up(nbytes)
    buf = _aligned_source(total)
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        with memoryview(buf) as view:
            done = 0
            while done < total:
                done += os.pwrite(fd, view[done : min(total, done + _DIRECT_BLOCK)], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def odirect_read(path: Path) -> float:
    """Read a whole file with O_DIRECT into aligned memory: the cold sequential read limit."""
    total = _round_up(path.stat().st_size)
    buf = _aligned_source(total)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with memoryview(buf) as view:
            done = 0
            while done < total:
                got = os.preadv(fd, [view[done : min(total, done + _DIRECT_BLOCK)]], done)
                if got <= 0:
                    break
                done += got
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def drop_page_cache(path: Path) -> str:
    """Make the next read of ``path`` (a file or a directory tree) come from the disk.

    As root the whole page cache is dropped; otherwise each file is fadvised out, which only
    works for clean pages, so everything is synced first.

    Returns:
        The method used, for the report: ``"drop_caches"`` or ``"fadvise"``.
    """
    os.sync()
    if os.geteuid() == 0:
        try:
            _DROP_CACHES.write_text("1\n")
            return "drop_caches"
        except OSError:
            pass  # a container with a read-only /proc/sys: fall back to per-file advice
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def settle_memory(*, quiet_s: float = 3.0, cap_s: float = 30.0) -> float:
    """Wait until the host has taken back the memory this machine freed; return the seconds waited.

    On a VM with free page reporting, memory the guest frees goes back to the host in bursts
    about every 2 s for up to tens of seconds, and touching it again costs a host page fault. A
    job resuming after a crash allocates memory that went back long before, so cold restores
    are timed on settled memory. Right after freeing they measure another machine: touching
    new memory is several times cheaper, and disk reads ran at half speed during the bursts
    on this VM. Returns at once where the kernel has no ``reported_kib`` counter.

    Args:
        quiet_s: How long the counter must stay still.
        cap_s: The longest wait.
    """
    gc.collect()  # what is garbage now is freed now, not in the middle of the timed call
    if not _REPORTED_KIB.exists():
        return 0.0
    t0 = time.monotonic()
    seen, still_since = _REPORTED_KIB.read_text(), t0
    while True:
        time.sleep(0.25)
        now, current = time.monotonic(), _REPORTED_KIB.read_text()
        if current != seen:
            seen, still_since = current, now
        if now - still_since >= quiet_s or now - t0 >= cap_s:
            return now - t0


def torch_save(state: Any, path: Path) -> float:
    """``torch.save`` to a file and fsync it: all of it is time the training loop waits."""
    t0 = time.perf_counter()
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def torch_load(path: Path) -> float:
    """``torch.load`` of a file written by :func:`torch_save` (the caller decides warm or cold)."""
    t0 = time.perf_counter()
    torch.load(path, weights_only=True)
    return time.perf_counter() - t0


def dcp_save(state: Any, directory: Path, *, threads: int) -> float:
    """``torch.distributed.checkpoint.save`` with a FileSystemWriter (fsyncs), single process."""
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=threads), no_dist=True)
    return time.perf_counter() - t0


def dcp_async_save(state: Any, directory: Path, *, threads: int) -> tuple[float, float]:
    """``torch.distributed.checkpoint.async_save``, single process.

    Returns:
        (seconds until ``async_save`` returned -- what training waits --, seconds until the
        returned future completed, i.e. the checkpoint is written and fsynced).
    """
    t0 = time.perf_counter()
    writer = FileSystemWriter(directory, thread_count=threads)
    fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
    waited = time.perf_counter() - t0
    fut.result()
    return waited, time.perf_counter() - t0


def warm_file(path: Path) -> None:
    """Read a file once so a following transfer reads it from the page cache, not the disk."""
    with path.open("rb") as f:
        while f.read(_DIRECT_BLOCK):
            pass


def s3_upload(client: Any, path: Path, bucket: str, key: str, *, part_size: int, concurrency: int) -> float:
    """boto3 managed multipart upload of a file (warm in the page cache) with parallel parts."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                         max_concurrency=concurrency)
    t0 = time.perf_counter()
    client.upload_file(str(path), bucket, key, Config=cfg)
    return time.perf_counter() - t0


def s3_download(client: Any, bucket: str, key: str, path: Path, *, part_size: int, concurrency: int) -> float:
    """boto3 managed download with parallel ranged GETs into a (page-cached, unsynced) file."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                         max_concurrency=concurrency)
    t0 = time.perf_counter()
    client.download_file(bucket, key, str(path), Config=cfg)
    return time.perf_counter() - t0


def s3torch_save(checkpoint: Any, state: Any, uri: str) -> float:
    """``torch.save`` streamed into s3torchconnector's ``S3Checkpoint.writer``."""
    t0 = time.perf_counter()
    with checkpoint.writer(uri) as w:
        torch.save(state, w)
    return time.perf_counter() - t0


def s3torch_load(checkpoint: Any, uri: str) -> float:
    """``torch.load`` streamed from s3torchconnector's ``S3Checkpoint.reader``."""
    t0 = time.perf_counter()
    with checkpoint.reader(uri) as r:
        torch.load(r, weights_only=True)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class S3Endpoint:
    """Where the S3 rows run: an endpoint on loopback and a bucket the bench may fill and empty.

    Credentials are the ``AWS_*`` variables of this process's environment.
    """

    endpoint_url: str
    bucket: str
    part_size: int
    concurrency: int

    def client(self) -> Any:
        """A boto3 client for the endpoint with path-style addressing and enough connections."""
        import boto3
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, max_pool_connections=2 * self.concurrency)
        return boto3.client("s3", endpoint_url=self.endpoint_url, config=cfg)


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _run_memcpy(state: Any, nbytes: int, repeat: int) -> list[Row]:
    return [
        measure(Row("memcpy", "memcpy into pre-faulted buffers", "limit", nbytes=nbytes),
                repeat, lambda: memcpy(state)),
        measure(Row("memcpy.torch", "torch copy_ into pre-faulted buffers", "limit", nbytes=nbytes,
                    note=f"{torch.get_num_threads()} intra-op threads"),
                repeat, lambda: torch_copy(state)),
        measure(Row("fault_in", "allocate + first touch of new tensors", "limit", nbytes=nbytes),
                repeat, lambda: fault_in(state)),
    ]


def _run_odirect(work: Path, nbytes: int, repeat: int) -> list[Row]:
    path = work / "odirect.bin"
    write = Row("odirect.write", "O_DIRECT write + fsync", "limit", nbytes=nbytes)
    read = Row("odirect.read", "O_DIRECT read (cold)", "limit", nbytes=nbytes)
    for _ in range(repeat):
        write.runs.append(odirect_write(path, nbytes))
        read.runs.append(odirect_read(path))
    path.unlink()
    return [write, read]


def _run_torch(state: Any, work: Path, nbytes: int, repeat: int) -> list[Row]:
    path = work / "torch.pt"
    save = measure(Row("torch.save", "torch.save + fsync", "baseline", nbytes=nbytes),
                   repeat, lambda: torch_save(state, path))
    # The file was just written, so its pages are still cached: this is the warm read.
    warm = measure(Row("torch.load_warm", "torch.load (page cache warm)", "baseline", nbytes=nbytes),
                   repeat, lambda: torch_load(path))
    cold = Row("torch.load_cold", "torch.load (page cache cold)", "baseline", nbytes=nbytes)
    for _ in range(repeat):
        cold.note = drop_page_cache(path)
        cold.runs.append(torch_load(path))
    path.unlink()
    return [save, warm, cold]


def _run_dcp(state: Any, work: Path, nbytes: int, repeat: int, threads: int) -> list[Row]:
    with warnings.catch_warnings():
        # Single-process DCP is what is measured here; its warning about that is noise.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _measure_dcp(state, work / "dcp", nbytes, repeat, threads)


def _measure_dcp(state: Any, target: Path, nbytes: int, repeat: int, threads: int) -> list[Row]:
    note = f"FileSystemWriter, {threads} threads"
    save = measure(Row("dcp.save", "DCP save", "baseline", nbytes=nbytes, note=note),
                   repeat, lambda: dcp_save(state, target, threads=threads), lambda: _fresh_dir(target))
    wait = Row("dcp.async_wait", "DCP async_save: training waits", "baseline", nbytes=nbytes, note=note)
    durable = Row("dcp.async_durable", "DCP async_save: until durable", "baseline", nbytes=nbytes, note=note)
    for _ in range(repeat):
        _fresh_dir(target)
        w, d = dcp_async_save(state, target, threads=threads)
        wait.runs.append(w)
        durable.runs.append(d)
    shutil.rmtree(target)
    return [save, wait, durable]


def _run_s3(state: Any, work: Path, repeat: int, s3: S3Endpoint) -> list[Row]:
    client = s3.client()
    payload, back, key = work / "s3payload.pt", work / "s3download.bin", "bench/boto3.bin"
    with payload.open("wb") as f:
        torch.save(state, f)
    size = payload.stat().st_size
    note = f"part {s3.part_size >> 20} MiB x {s3.concurrency}"
    up = measure(Row("s3.upload", "boto3 multipart upload", "limit", nbytes=size, note=note), repeat,
                 lambda: s3_upload(client, payload, s3.bucket, key, part_size=s3.part_size,
                                   concurrency=s3.concurrency),
                 lambda: warm_file(payload))
    down = measure(Row("s3.download", "boto3 parallel download", "limit", nbytes=size, note=note), repeat,
                   lambda: s3_download(client, s3.bucket, key, back, part_size=s3.part_size,
                                       concurrency=s3.concurrency),
                   lambda: back.unlink(missing_ok=True))
    client.delete_object(Bucket=s3.bucket, Key=key)
    payload.unlink()
    back.unlink()
    return [up, down]


def _run_s3torch(state: Any, nbytes: int, repeat: int, s3: S3Endpoint) -> list[Row]:
    rows = (("s3torch.save", "s3torchconnector S3Checkpoint save"),
            ("s3torch.load", "s3torchconnector S3Checkpoint load"))
    try:
        from s3torchconnector import S3Checkpoint, S3ClientConfig
    except ImportError as e:
        return [unavailable(k, n, "baseline", f"s3torchconnector not installed ({e})") for k, n in rows]
    ckpt = S3Checkpoint(region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), endpoint=s3.endpoint_url,
                        s3client_config=S3ClientConfig(force_path_style=True, part_size=s3.part_size))
    uri = f"s3://{s3.bucket}/bench/s3torch.pt"
    try:
        save = measure(Row(rows[0][0], rows[0][1], "baseline", nbytes=nbytes),
                       repeat, lambda: s3torch_save(ckpt, state, uri))
        load = measure(Row(rows[1][0], rows[1][1], "baseline", nbytes=nbytes),
                       repeat, lambda: s3torch_load(ckpt, uri))
    except Exception as e:  # the CRT client reports endpoint problems with its own exception types
        return [unavailable(k, n, "baseline", f"{type(e).__name__}: {e}") for k, n in rows]
    s3.client().delete_object(Bucket=s3.bucket, Key="bench/s3torch.pt")
    return [save, load]


BASELINE_GROUPS = ("memcpy", "odirect", "torch", "dcp", "s3", "s3torch")
_S3_BASELINES = ("s3", "s3torch")


def run_baselines(state: Any, work: Path, *, repeat: int, groups: Sequence[str], s3: S3Endpoint | None,
                  dcp_threads: int) -> list[Row]:
    """Measure the selected baseline groups (see ``BASELINE_GROUPS``) on ``state``, in order.

    Args:
        state: The state dict every row saves.
        work: Scratch directory on the filesystem under test; the rows leave nothing in it.
        repeat: Runs per row (the table shows the median).
        groups: Which groups to run.
        s3: The S3 endpoint, or ``None`` to skip the S3 groups.
        dcp_threads: Writer threads for DCP's FileSystemWriter (the same as tiercache's disk tier).

    Returns:
        The rows, in group order.
    """
    nbytes = state_nbytes(state)
    rows: list[Row] = []
    for group in groups:
        if group not in BASELINE_GROUPS or (group in _S3_BASELINES and s3 is None):
            continue
        progress(group)
        if group == "memcpy":
            rows += _run_memcpy(state, nbytes, repeat)
        elif group == "odirect":
            rows += _run_odirect(work, nbytes, repeat)
        elif group == "torch":
            rows += _run_torch(state, work, nbytes, repeat)
        elif group == "dcp":
            rows += _run_dcp(state, work, nbytes, repeat, dcp_threads)
        elif group == "s3" and s3 is not None:
            rows += _run_s3(state, work, repeat, s3)
        elif group == "s3torch" and s3 is not None:
            rows += _run_s3torch(state, nbytes, repeat, s3)
        gc.collect()
    return rows
