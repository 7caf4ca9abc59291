"""Benchmark results: the row model, the targets, the rich table, results.json and the PNG chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import torch
from rich.console import Console
from rich.table import Table

Kind = Literal["limit", "baseline", "tiercache"]


@dataclass
class Row:
    """One measured quantity: the median of its runs, or why it could not be measured.

    Attributes:
        key: Stable id used by targets and ``results.json`` (``"memcpy"``, ``"tc.save_wait"``).
        name: What the table prints.
        kind: A hardware limit, a baseline library, or tiercache itself.
        runs: Every run's value (seconds, or GB for ``unit="GB"``).
        nbytes: Bytes moved per run, for the GB/s column; 0 when throughput means nothing.
        unit: ``"s"`` for durations, ``"GB"`` for memory sizes.
        note: Anything the reader needs (``"n/a: <reason>"``, how the page cache was dropped).
    """

    key: str
    name: str
    kind: Kind
    runs: list[float] = field(default_factory=list)
    nbytes: int = 0
    unit: Literal["s", "GB"] = "s"
    note: str = ""

    @property
    def value(self) -> float | None:
        """The median of the runs, or ``None`` when the row was not measured."""
        return statistics.median(self.runs) if self.runs else None

    @property
    def gbps(self) -> float | None:
        """Throughput of the median run in GB/s (10^9 bytes), when that means something."""
        v = self.value
        return self.nbytes / v / 1e9 if v and self.nbytes and self.unit == "s" else None


def progress(group: str) -> None:
    """Say on stderr which group starts, so a run of several minutes shows where it is."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {group}", file=sys.stderr, flush=True)


def measure(row: Row, repeat: int, run: Callable[[], float], setup: Callable[[], None] | None = None) -> Row:
    """Append ``repeat`` runs of ``run`` to ``row``, calling ``setup`` (untimed) before each."""
    for _ in range(repeat):
        if setup is not None:
            setup()
        row.runs.append(run())
    return row


def unavailable(key: str, name: str, kind: Kind, reason: str) -> Row:
    """A row that could not be measured, printed as ``n/a: reason``."""
    return Row(key, name, kind, note=f"n/a: {reason}")


@dataclass(frozen=True)
class Target:
    """A claim: ``row`` compared with its limit and with the best baseline.

    ``row / limit <= limit_max`` and ``row / min(best) <= best_max`` (either bound may be absent,
    and then the ratio is shown without a verdict). ``limit`` lists alternatives, preferred
    first: the first one measured is the limit (a limit timed in alternation with ``row`` sees
    the same disk as ``row`` did, where a noisy virtual disk drifts between groups).
    """

    row: str
    limit: tuple[str, ...]
    best: tuple[str, ...]
    limit_max: float | None
    best_max: float | None
    text: str


TARGETS: tuple[Target, ...] = (
    Target("tc.save_wait", ("memcpy",), ("dcp.async_wait",), 1.5, 0.5,
           "<= 1.5x memcpy, <= 0.5x DCP async_save wait"),
    Target("tc.local", ("odirect.write_paired", "odirect.write"),
           ("torch.save", "dcp.save", "dcp.async_durable"), 1.2, None,
           "<= 1.2x O_DIRECT write"),
    Target("tc.remote", ("s3.upload",), ("s3torch.save",), None, None, ""),
    Target("tc.restore_ram", ("memcpy_paired", "memcpy"), ("torch.load_warm",), 1.25, None,
           "at memcpy speed (<= 1.25x)"),
    # Cold restores against the baselines timed in the same state (memory settled, see
    # bench.baselines.settle_memory): the unpaired torch.load row ran on freshly freed memory.
    Target("tc.restore_disk", ("odirect.read_paired", "odirect.read"), ("torch.load_cold_paired",), None, 1 / 3,
           ">= 3x faster than torch.load cold"),
    Target("tc.restore_disk_into", ("odirect.read_paired", "odirect.read"), ("torch.load_cold_paired",), None, None,
           ""),
    Target("tc.restore_s3", ("s3.download",), ("s3torch.load",), None, None, ""),
    Target("tc.rss_peak", ("tc.rss_budget",), (), 1.0, None, "<= RAM capacity x1.05 + state"),
    Target("tc.loop_slowdown", ("loop.memcpy",), (), 1.0, None, "< memcpy of the loop's state"),
    Target("tc.loop_slowdown_deferred", ("loop.memcpy",), (), 1.0, None, "< memcpy of the loop's state"),
    Target("restart.ram", ("restart.memcpy",), (), 1.2, None, "<= 1.2x a memcpy of the same bytes"),
    Target("agentloop.agent_1", (), ("agentloop.engine_1", "agentloop.dcp_1"), None, 1.0,
           "the smallest slowdown of the three"),
    Target("agentloop.agent_10", (), ("agentloop.engine_10", "agentloop.dcp_10"), None, 1.0,
           "the smallest slowdown of the three"),
    Target("tc.cli_help", ("cli.help_budget",), (), 1.0, None, "< 0.3 s"),
    Target("tc.cli_ls", ("cli.ls_budget",), (), 1.0, None, "< 0.5 s on a disk-only cache"),
)


@dataclass
class Verdict:
    """A target evaluated on the measured rows."""

    target: Target
    limit_key: str | None
    limit_ratio: float | None
    best_ratio: float | None
    best_name: str | None
    met: bool | None


def _ratio(rows: dict[str, Row], num: str, den: str) -> float | None:
    a, b = rows.get(num), rows.get(den)
    if a is None or b is None or a.value is None or not b.value:
        return None
    return a.value / b.value


def _within(ratio: float | None, bound: float | None) -> bool | None:
    if bound is None:
        return True
    return None if ratio is None else ratio <= bound


def evaluate(rows: Sequence[Row]) -> list[Verdict]:
    """Evaluate every target whose row was measured; a missing reference leaves it undecided."""
    by_key = {r.key: r for r in rows}
    out: list[Verdict] = []
    for t in TARGETS:
        if t.row not in by_key or by_key[t.row].value is None:
            continue
        limit = next((k for k in t.limit if by_key.get(k) is not None and by_key[k].value), None)
        limit_ratio = _ratio(by_key, t.row, limit) if limit else None
        measured = [b for b in t.best if by_key.get(b) is not None and by_key[b].value]
        best = min(measured, key=lambda b: by_key[b].value or 0.0) if measured else None
        best_ratio = _ratio(by_key, t.row, best) if best else None
        checks = [_within(limit_ratio, t.limit_max), _within(best_ratio, t.best_max)]
        met = None if not t.text or None in checks else all(checks)
        out.append(Verdict(t, limit, limit_ratio, best_ratio, by_key[best].name if best else None, met))
    return out


def _mount_of(path: Path) -> tuple[str, str]:
    """(filesystem type, device) of the mount holding ``path``: the longest matching mount point."""
    best = ("?", "?", "")
    real = str(path.resolve())
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[2]):
            best = (part.fstype, part.device, mp)
    return best[0], best[1]


def machine_info(bench_dir: Path) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    fstype, device = _mount_of(bench_dir)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "bench_dir": str(bench_dir),
        "filesystem": f"{fstype} on {device}",
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # Other processes on a small machine skew every row: the 1-minute load says how much.
        "load_1min": round(os.getloadavg()[0], 2),
    }


def _fmt_value(row: Row) -> str:
    v = row.value
    if v is None:
        return "-"
    return f"{v:.2f} GB" if row.unit == "GB" else f"{v:.3f} s"


def _fmt_ratio(r: float | None, bound: float | None) -> str:
    if r is None:
        return ""
    text = f"{r:.2f}x"
    return text if bound is None else f"{text} (<= {bound:.2f})"


def _fmt_limit(v: Verdict, rows: dict[str, Row]) -> str:
    """The ratio to the limit; named when the target has alternatives, so the reader knows which."""
    text = _fmt_ratio(v.limit_ratio, v.target.limit_max)
    if text and len(v.target.limit) > 1 and v.limit_key in rows:
        text += f" {rows[v.limit_key].name}"
    return text


def render(rows: Sequence[Row], verdicts: Sequence[Verdict], machine: dict[str, Any],
           header: str, console: Console) -> None:
    """Print the machine, the table of all rows and the target verdicts."""
    console.print("[bold]machine[/bold]: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    console.print(header)
    by_row = {v.target.row: v for v in verdicts}
    by_key = {r.key: r for r in rows}
    table = Table(title="tiercache vs limits and baselines (median of runs)")
    for col, justify in (("row", "left"), ("kind", "left"), ("value", "right"), ("GB/s", "right"),
                         ("vs limit", "right"), ("vs best baseline", "left"), ("target", "left"),
                         ("note", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        v = by_row.get(r.key)
        verdict = {True: "[green]met[/green]", False: "[red]missed[/red]", None: ""}[v.met if v else None]
        best = ""
        if v and v.best_ratio is not None:
            best = f"{_fmt_ratio(v.best_ratio, v.target.best_max)} {v.best_name}"
        table.add_row(
            r.name, r.kind, _fmt_value(r), f"{r.gbps:.2f}" if r.gbps else "",
            _fmt_limit(v, by_key) if v else "", best,
            (v.target.text + " " + verdict).strip() if v else "", r.note,
        )
    console.print(table)


def write_json(path: Path, rows: Sequence[Row], verdicts: Sequence[Verdict],
               machine: dict[str, Any], settings: dict[str, Any]) -> None:
    """Write every run of every row, the verdicts, the machine and the settings as JSON."""
    doc = {
        "machine": machine,
        "settings": settings,
        "rows": [asdict(r) | {"median": r.value, "gbps": r.gbps} for r in rows],
        "targets": [
            {"row": v.target.row, "target": v.target.text, "limit": v.limit_key,
             "limit_ratio": v.limit_ratio, "best": v.best_name, "best_ratio": v.best_ratio, "met": v.met}
            for v in verdicts
        ],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


_COLORS = {"limit": "#7f7f7f", "baseline": "#1f77b4", "tiercache": "#d62728"}


def write_png(path: Path, rows: Sequence[Row], title: str) -> None:
    """Horizontal bar chart of every measured duration (log scale), coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timed = [r for r in rows if r.unit == "s" and r.value]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(timed) + 1.5))
    ax.barh([r.name for r in timed], [r.value or 0.0 for r in timed],
            color=[_COLORS[r.kind] for r in timed])
    for i, r in enumerate(timed):
        label = f" {r.value:.3f}s" + (f"  {r.gbps:.2f} GB/s" if r.gbps else "")
        ax.text(r.value or 0.0, i, label, va="center", fontsize=8)
    ax.set_xscale("log")
    # Room on the right for the labels of the longest bars.
    ax.set_xlim(right=max((r.value or 0.0 for r in timed), default=1.0) * 6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (log scale, lower is better)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
