"""The node agent's rows: restart to training, and a training loop that checkpoints.

``restart``: a trainer saved the state through the agent (RAM + disk, + S3 if any) and died;
a fresh process restores it into the tensors of its freshly built model. Each run is a new
process (``python -m bench.agent child ...``), as after a crash: it opens the cache, builds
pre-faulted destination tensors (the model: not timed), runs one full garbage collection (timed
on its own: see below), times a memcpy of the same bytes between pre-faulted buffers (the
limit), then its restore: from node RAM through the agent (after
``prepare()`` maps the agent's arena and builds its page tables: the open-to-training total counts
that too; the ablation row restores without it), from the disk alone with the page cache dropped,
or from S3 alone. Each process starts once the memory the one before freed has gone back to the
host (``settle_memory``). Every restore is checked bit-exact against the saved
state (a digest). The node-RAM process then times the same memcpy and restore once more
(``restart.ram_again``).

Why the collection: a fresh process that imported torch and built its model is due for a full
CPython garbage collection (~0.1 s over its ~240 000 objects), and whatever code allocates next
sets it off: without the collection, the first restore paid it (or, with fewer objects at open,
the second). That debt is the start-up's, not the restore's, so it is paid before the timed pair
and reported on its own; the open-to-training total counts it (``restart.<source>_total``).

``agentloop``: the CPU MLP loop of ``bench.save_restore`` (~100 MB of state, 1 torch thread),
checkpointing every step and every 10 steps, in three fresh processes: tiercache in process,
tiercache through a node agent, and ``torch.distributed.checkpoint.async_save`` with
``AsyncCheckpointerType.PROCESS`` (its own checkpoint process; each save first waits for the one
before, as its staging buffers require). The two tiercache caches are RAM + disk (a 3 GiB disk
budget), with or without ``--no-s3``: DCP writes a local directory, so all three write the same
disk. Plain and checkpointing blocks alternate in each
process; the slowdown is the median of the block-to-block differences, per step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import tiercache
from bench.baselines import S3Endpoint, drop_page_cache, settle_memory
from bench.report import Row, progress
from bench.save_restore import _LOOP_STEPS, _Loop, cache_config, ram_capacity
from bench.state import advance, iter_tensors, state_nbytes
from tiercache.agent.client import listening

AGENT_GROUPS = ("restart", "agentloop")
ROOT = Path(__file__).resolve().parents[1]
#: Checkpointing blocks per loop variant and save interval (each paired with a plain block).
_LOOP_BLOCKS = 8
_LOOP_BLOCK_STEPS = 2 * _LOOP_STEPS


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


class _Agent:
    """A node agent for the bench's caches, run as an operator would run it."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self.config = config
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "tiercache", "agent", "--spec-fd", "0"], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=log.open("ab"))
        assert self.proc.stdin is not None
        with self.proc.stdin:  # the config through a pipe, as an auto-started agent gets it
            self.proc.stdin.write(json.dumps(config).encode())
        sock = Path(config["agent"]["socket"])
        deadline = time.monotonic() + 300
        while not listening(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bench's agent did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(600)


def _with_agent(cfg: dict[str, Any], sock_dir: Path) -> dict[str, Any]:
    return {**cfg, "agent": {"socket": str(sock_dir / "a.sock"), "start": "never", "idle_exit": 0}}


def _child_process(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "bench.agent", "child", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ restart


def _restart_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: open the cache, build the model's tensors, time a memcpy, then the restore."""
    from tiercache.format import dtype_from_name, unflatten

    t0 = time.perf_counter()
    cache = tiercache.open(spec["config"])
    opened = time.perf_counter() - t0
    version = cache.manifest(spec["version"])
    dests = [torch.empty(e.shape, dtype=dtype_from_name(e.dtype)).fill_(1) for e in version.tensors]
    into = unflatten(version.tree, dests)
    sources = [torch.empty_like(d).fill_(2) for d in dests]  # the limit: the same bytes, memory to memory
    import ctypes
    import gc

    t0 = time.perf_counter()
    gc.collect()  # the start-up's collection debt (see the module docstring)
    collected = time.perf_counter() - t0

    def memcpy(sources: list[torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for s, d in zip(sources, dests, strict=True):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
        return time.perf_counter() - t0

    memcpy_s = memcpy(sources)
    prepared = 0.0
    if spec["prepare"]:
        t0 = time.perf_counter()
        cache.prepare(wait=True)  # with an agent: map its arena and build the page tables
        prepared = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.restore(spec["version"], into=into, resume=False)
    restored = time.perf_counter() - t0
    report = cache.last_restore
    ok = _digest(dests) == spec["digest"]
    again = None
    if spec.get("again"):  # the same pair once more: what the first restore paid once per process
        again_memcpy = memcpy(sources)
        t0 = time.perf_counter()
        cache.restore(spec["version"], into=into, resume=False)
        again = {"memcpy": again_memcpy, "restore": time.perf_counter() - t0}
        ok = ok and _digest(dests) == spec["digest"]
    del sources
    cache.close()
    return {"open": opened, "collect": collected, "prepare": prepared, "restore": restored, "memcpy": memcpy_s,
            "exact": ok,
            "sources": sorted(report.nbytes) if report else [], "again": again}


def _run_restart(state: dict[str, Any], work: Path, repeat: int, s3: S3Endpoint | None, policy: str) -> list[Row]:
    nbytes = state_nbytes(state)
    sock_dir = Path(tempfile.mkdtemp(prefix="tcb-", dir="/tmp"))
    base = cache_config(work, "restart", ram_capacity(nbytes), s3, policy)
    cfg = _with_agent(base, sock_dir)
    agent = _Agent(cfg, work / "restart-agent.log")
    try:
        advance(state)
        with tiercache.open(cfg) as cache:
            h = cache.save(state, step=state["step"])
            h.wait("local")
            if s3 is not None:
                h.wait("remote")
            version = h.version
        digest = _digest(list(iter_tensors(state)))
        disk_only = {k: v for k, v in base.items() if k not in ("ram", "s3")}
        s3_only = {k: v for k, v in base.items() if k not in ("ram", "disk")}
        variants = [("ram", cfg, True), ("ram_unprepared", cfg, False), ("disk", disk_only, False)]
        if s3 is not None:
            variants.append(("s3", s3_only, False))
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
        settled: list[float] = []
        for _ in range(repeat):
            for name, config, prepare in variants:  # interleaved: each source sees the same machine
                if name == "disk":
                    drop_page_cache(work / "restart")
                # Every process starts on settled memory: right after the last one exited, the host
                # takes its freed memory back in bursts, and copies ran up to 1.6x slower meanwhile.
                settled.append(settle_memory())
                got = _child_process({"mode": "restart", "config": config, "version": version, "digest": digest,
                                      "prepare": prepare, "again": name == "ram"})
                if not got["exact"]:
                    raise RuntimeError(f"restore from {name} in a fresh process was not bit-exact")
                results[name].append(got)
    finally:
        agent.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    memcpy = Row("restart.memcpy", "memcpy of the state in the restarted process (pre-faulted buffers)", "limit",
                 runs=[r["memcpy"] for rs in results.values() for r in rs], nbytes=nbytes,
                 note=f"each process started on settled freed memory (waited {min(settled):.0f}-{max(settled):.0f} s)")
    rows = [memcpy]
    names = {"ram": "node RAM (through the agent)", "ram_unprepared": "node RAM, arena not mapped ahead (ablation)",
             "disk": "disk alone, cold", "s3": "S3 alone"}
    for name, rs in results.items():
        sources = ", ".join(sorted({s for r in rs for s in r["sources"]}))
        rows.append(Row(f"restart.{name}", f"restart: restore from {names[name]}", "tiercache",
                        runs=[r["restore"] for r in rs], nbytes=nbytes, note=f"read from {sources}"))
        total = [r["open"] + r["collect"] + r["prepare"] + r["restore"] for r in rs]
        rows.append(Row(f"restart.{name}_total", f"... open() + gc + prepare() + restore(), {names[name]}",
                        "tiercache", runs=total, nbytes=nbytes,
                        note=f"open {statistics.median(r['open'] for r in rs):.3f} s, start-up's garbage "
                             f"collection {statistics.median(r['collect'] for r in rs):.3f} s, prepare "
                             f"{statistics.median(r['prepare'] for r in rs):.3f} s"))
    next(r for r in rows if r.key == "restart.disk").note += "; page cache dropped"
    again = [r["again"] for r in results["ram"]]
    ratios = [a["restore"] / a["memcpy"] for a in again]
    rows.append(Row("restart.ram_again", "restart: a second restore from node RAM in the same process", "tiercache",
                    runs=[a["restore"] for a in again], nbytes=nbytes,
                    note=f"{statistics.median(ratios):.2f}x its paired memcpy "
                         f"({statistics.median(a['memcpy'] for a in again):.3f} s)"))
    return rows


# ------------------------------------------------------------------------ the training loop


def _loop_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One loop variant in a fresh process: alternate plain and checkpointing blocks at each interval."""
    torch.set_num_threads(1)
    variant, work = spec["variant"], Path(spec["work"])
    loop = _Loop()
    saver = _DcpSaver(work) if variant == "dcp" else _CacheSaver(spec["config"])
    out: dict[str, Any] = {}
    try:
        for every in (1, 10):
            saver.save(loop, force=True)  # first save (allocations) outside the timing
            saver.drain()
            diffs, waits = [], []
            for _ in range(_LOOP_BLOCKS):
                saver.drain()
                base = _block(loop, None, every)[0]
                _block(loop, saver, every)  # warm: the block timed next carries the background work of this one
                per_step, waited = _block(loop, saver, every)
                diffs.append(per_step - base)
                waits.append(waited)
            out[str(every)] = {"slowdown": diffs, "in_save": waits}
    finally:
        saver.close()
    out["state_bytes"] = state_nbytes(loop.state)
    return out


def _block(loop: _Loop, saver: Any, every: int) -> tuple[float, float]:
    in_save = 0.0
    t0 = time.perf_counter()
    for _ in range(_LOOP_BLOCK_STEPS):
        loop.run(1, None)
        if saver is not None and loop.step % every == 0:
            t1 = time.perf_counter()
            saver.save(loop)
            in_save += time.perf_counter() - t1
    return (time.perf_counter() - t0) / _LOOP_BLOCK_STEPS, in_save / _LOOP_BLOCK_STEPS


class _CacheSaver:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cache = tiercache.open(config)

    def save(self, loop: _Loop, force: bool = False) -> None:
        self.cache.save(loop.state, step=loop.step)

    def drain(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        self.cache.close()


class _DcpSaver:
    """``dcp.async_save`` with its checkpoint process; keeps the two newest checkpoints on disk."""

    def __init__(self, work: Path) -> None:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("gloo", rank=0, world_size=1)
        self.work = work
        self.pending: Any = None
        self.dirs: list[Path] = []

    def save(self, loop: _Loop, force: bool = False) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.drain()  # its staging buffers are reused: a save waits for the one before
        target = self.work / f"step{loop.step}"
        self.pending = dcp.async_save(loop.state, checkpoint_id=str(target),
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        self.dirs.append(target)

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def close(self) -> None:
        import torch.distributed as dist

        self.drain()
        dist.destroy_process_group()


def _run_agentloop(work: Path, policy: str) -> list[Row]:
    sock_dir = Path(tempfile.mkdtemp(prefix="tcb-", dir="/tmp"))
    base = cache_config(work, "agentloop", 512 << 20, None, policy)
    base["disk"]["capacity"] = "3GiB"  # a budget: the policy evicts old versions, the disk stays small
    agent_cfg = _with_agent(base, sock_dir)
    agent = _Agent(agent_cfg, work / "agentloop-agent.log")
    results: dict[str, dict[str, Any]] = {}
    try:
        for variant, config in (("engine", base), ("agent", agent_cfg), ("dcp", None)):
            progress(f"loop: {variant}")
            (work / variant).mkdir(exist_ok=True)
            results[variant] = _child_process({"mode": "loop", "variant": variant, "config": config,
                                               "work": str(work / variant)})
            shutil.rmtree(work / variant, ignore_errors=True)
    finally:
        agent.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    nbytes = results["engine"]["state_bytes"]
    names = {"engine": "tiercache in process", "agent": "tiercache through the node agent",
             "dcp": "DCP async_save (process)"}
    kinds = {"engine": "tiercache", "agent": "tiercache", "dcp": "baseline"}
    rows = []
    for every in ("1", "10"):
        for variant in ("engine", "agent", "dcp"):
            got = results[variant][every]
            rows.append(Row(f"agentloop.{variant}_{every}", f"loop slowdown per step, saving every {every} step(s): "
                            f"{names[variant]}", kinds[variant], runs=got["slowdown"],  # type: ignore[arg-type]
                            note=f"inside save(): {statistics.median(got['in_save']):.4f} s/step; state "
                                 f"{nbytes / 1e6:.0f} MB, {_LOOP_BLOCKS} block pairs of {_LOOP_BLOCK_STEPS} steps; "
                                 "to the disk (no S3)"))
    return rows


def run_agent(state: dict[str, Any], work: Path, *, repeat: int, groups: Sequence[str], s3: S3Endpoint | None,
              policy: str) -> list[Row]:
    """Measure the selected agent groups (see ``AGENT_GROUPS``)."""
    rows: list[Row] = []
    root = work / "agent"
    root.mkdir(exist_ok=True)
    if "restart" in groups:
        progress("agent: restart to training")
        rows += _run_restart(state, root, repeat, s3, policy)
    if "agentloop" in groups:
        progress("agent: training loops")
        rows += _run_agentloop(root, policy)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def _main(argv: Sequence[str]) -> None:
    if len(argv) == 2 and argv[0] == "child":
        spec = json.loads(argv[1])
        result = _restart_child(spec) if spec["mode"] == "restart" else _loop_child(spec)
        print(json.dumps(result), flush=True)
        return
    raise SystemExit("usage: python -m bench.agent child SPEC_JSON (run by python -m bench)")


if __name__ == "__main__":
    _main(sys.argv[1:])
