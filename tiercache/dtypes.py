"""The one table of tensor dtypes tiercache stores: name, element size, and whether it is a float.

Names are torch's (``float32``, ``bfloat16``...); they are what manifests record. This module does
not import torch, so reading manifests (``tiercache ls``) never pays for it; :mod:`tiercache.format`
maps the names to torch dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One storable dtype.

    Attributes:
        itemsize: Bytes per element.
        grouped: Whether byte-grouped compression is made for it (the float types whose bytes
            split into sign/exponent and mantissa planes: fp64, fp32, fp16, bf16).
        complex: Whether it is a complex type (restore must keep its conjugation bit clear).
    """

    itemsize: int
    grouped: bool = False
    complex: bool = False


DTYPES: dict[str, DType] = {
    "float64": DType(8, grouped=True), "float32": DType(4, grouped=True), "float16": DType(2, grouped=True),
    "bfloat16": DType(2, grouped=True),
    "float8_e4m3fn": DType(1), "float8_e4m3fnuz": DType(1), "float8_e5m2": DType(1), "float8_e5m2fnuz": DType(1),
    "float8_e8m0fnu": DType(1),
    "complex128": DType(16, complex=True), "complex64": DType(8, complex=True), "complex32": DType(4, complex=True),
    "int64": DType(8), "int32": DType(4), "int16": DType(2), "int8": DType(1),
    "uint64": DType(8), "uint32": DType(4), "uint16": DType(2), "uint8": DType(1), "bool": DType(1),
}

#: Dtypes whose bytes byte-grouped compression is made for.
GROUPED = frozenset(n for n, d in DTYPES.items() if d.grouped)


def float_share(dtypes_and_bytes: list[tuple[str, int]]) -> float:
    """Share of the bytes that are of a :data:`GROUPED` dtype (for the policy's codec choice)."""
    total = sum(n for _, n in dtypes_and_bytes)
    return sum(n for d, n in dtypes_and_bytes if d in GROUPED) / total if total else 0.0
