"""Chunk header, codecs and content ids: bit-exact round trips and corruption detection."""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash
import zstandard

from tiercache.codecs import (
    BGZSTD,
    HEADER_BYTES,
    RAW,
    ZSTD,
    ChunkHeader,
    chunk_object,
    codec_names,
    content_id,
    decode,
    encode,
    hasher,
    pack_header,
    read_header,
    seal_chunk,
    write_header,
)
from tiercache.errors import ConfigError, IntegrityError

ALL_CODECS = [RAW, ZSTD, BGZSTD]
ITEMSIZES = [1, 2, 4, 8]


def _tensor_bytes(dtype: torch.dtype, n: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype).view(torch.uint8).numpy().tobytes()


DATASETS: dict[str, bytes] = {
    # An odd length leaves a tail shorter than one element for every itemsize.
    "random": np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8).tobytes(),
    "zeros": bytes(65_536),
    "empty": b"",
    "one-byte": b"\x7f",
    "fp32": _tensor_bytes(torch.float32, 20_000, 2),
    "bf16": _tensor_bytes(torch.bfloat16, 20_000, 3),
    "fp16": _tensor_bytes(torch.float16, 20_000, 4),
    "fp64": _tensor_bytes(torch.float64, 20_000, 5),
}


def _roundtrip(codec: str, data: bytes, itemsize: int) -> bytes:
    payload = encode(codec, memoryview(data), itemsize=itemsize)
    out = bytearray(len(data))
    decode(codec, memoryview(payload), len(data), memoryview(out), itemsize=itemsize)
    return bytes(out)


def test_codec_names_lists_the_registered_descriptors() -> None:
    assert codec_names() == ["bgzstd/1", "raw/1", "zstd/1"]


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("codec", ALL_CODECS)
def test_roundtrip_is_bit_exact(codec: str, itemsize: int, name: str) -> None:
    data = DATASETS[name]
    assert _roundtrip(codec, data, itemsize) == data


@pytest.mark.parametrize("level", [-5, 1, 3, 19])
@pytest.mark.parametrize("codec", [ZSTD, BGZSTD])
def test_roundtrip_at_every_level(codec: str, level: int) -> None:
    data = DATASETS["bf16"]
    payload = encode(codec, memoryview(data), itemsize=2, level=level)
    out = bytearray(len(data))
    decode(codec, memoryview(payload), len(data), memoryview(out), itemsize=2)
    assert bytes(out) == data


def test_multithreaded_zstd_roundtrip() -> None:
    data = DATASETS["fp32"]
    payload = encode(ZSTD, memoryview(data), threads=2)
    assert zstandard.ZstdDecompressor().decompress(payload) == data


def test_decode_lands_straight_in_tensor_memory() -> None:
    src = torch.randn(3, 1000, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
    raw = memoryview(src.view(torch.uint8).numpy()).cast("B")
    payload = encode(BGZSTD, raw, itemsize=4)
    dst = torch.empty_like(src)
    decode(BGZSTD, memoryview(payload), raw.nbytes, memoryview(dst.view(torch.uint8).numpy()), itemsize=4)
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))


def test_encode_accepts_typed_buffers_without_conversion() -> None:
    arr = np.arange(1000, dtype=np.float32)
    assert encode(RAW, memoryview(arr)) == arr.tobytes()


def test_raw_payload_is_the_data_and_zstd_payload_is_a_standard_frame() -> None:
    data = DATASETS["fp16"]
    assert encode(RAW, memoryview(data)) == data
    frame = encode(ZSTD, memoryview(data))
    params = zstandard.get_frame_parameters(frame)
    assert (params.content_size, params.has_checksum) == (len(data), True)
    assert zstandard.ZstdDecompressor().decompress(frame) == data


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_bgzstd_payload_holds_the_byte_planes_in_order(itemsize: int) -> None:
    data = DATASETS["random"]
    planes = zstandard.ZstdDecompressor().decompress(encode(BGZSTD, memoryview(data), itemsize=itemsize))
    whole = len(data) - len(data) % itemsize
    expected = b"".join(data[i:whole:itemsize] for i in range(itemsize)) + data[whole:]
    assert planes == expected


def test_bgzstd_with_itemsize_one_is_plain_zstd() -> None:
    data = DATASETS["fp32"]
    assert encode(BGZSTD, memoryview(data), itemsize=1) == encode(ZSTD, memoryview(data))


@pytest.mark.parametrize(
    ("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2), (torch.float64, 8)]
)
def test_bgzstd_beats_zstd_on_randn_weights(dtype: torch.dtype, itemsize: int) -> None:
    data = _tensor_bytes(dtype, 1 << 18, 7)
    grouped = len(encode(BGZSTD, memoryview(data), itemsize=itemsize))
    plain = len(encode(ZSTD, memoryview(data)))
    assert grouped < plain < len(data)


def test_encode_rejects_unknown_codec_and_bad_knobs() -> None:
    data = memoryview(b"abcd")
    with pytest.raises(ConfigError, match="unknown codec"):
        encode("lz4/1", data)
    with pytest.raises(ConfigError, match="itemsize"):
        encode(BGZSTD, data, itemsize=3)
    with pytest.raises(ConfigError, match="level"):
        encode(ZSTD, data, level=23)
    with pytest.raises(ConfigError, match="threads"):
        encode(ZSTD, data, level=4, threads=-1)


def test_decode_rejects_unknown_codec_itemsize_and_wrong_output_size() -> None:
    data = DATASETS["fp32"]
    payload = memoryview(encode(ZSTD, memoryview(data)))
    with pytest.raises(IntegrityError, match="unknown codec"):
        decode("zstd/2", payload, len(data), memoryview(bytearray(len(data))))
    with pytest.raises(IntegrityError, match="itemsize"):
        decode(BGZSTD, payload, len(data), memoryview(bytearray(len(data))), itemsize=16)
    with pytest.raises(IntegrityError, match="output buffer"):
        decode(ZSTD, payload, len(data), memoryview(bytearray(len(data) - 1)))


@pytest.mark.parametrize("codec", [ZSTD, BGZSTD])
def test_decode_rejects_a_raw_len_the_frame_does_not_declare(codec: str) -> None:
    data = DATASETS["fp32"]
    payload = memoryview(encode(codec, memoryview(data), itemsize=4))
    for raw_len in (len(data) - 4, len(data) + 4):
        with pytest.raises(IntegrityError, match="declares"):
            decode(codec, payload, raw_len, memoryview(bytearray(raw_len)), itemsize=4)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_decode_rejects_truncated_payloads(codec: str) -> None:
    data = DATASETS["bf16"]
    payload = encode(codec, memoryview(data), itemsize=2)
    for cut in (0, 1, 5, len(payload) // 2, len(payload) - 4, len(payload) - 1):
        with pytest.raises(IntegrityError):
            decode(codec, memoryview(payload[:cut]), len(data), memoryview(bytearray(len(data))), itemsize=2)


@pytest.mark.parametrize("codec", [ZSTD, BGZSTD])
def test_decode_rejects_bytes_after_the_frame(codec: str) -> None:
    data = DATASETS["fp32"]
    payload = encode(codec, memoryview(data), itemsize=4) + b"\x00\x01\x02\x03"
    with pytest.raises(IntegrityError, match="checksum"):
        decode(codec, memoryview(payload), len(data), memoryview(bytearray(len(data))), itemsize=4)


def test_raw_decode_rejects_an_overlong_payload() -> None:
    with pytest.raises(IntegrityError, match="raw payload"):
        decode(RAW, memoryview(b"abcde"), 4, memoryview(bytearray(4)))


@pytest.mark.parametrize("codec", [ZSTD, BGZSTD])
def test_decode_rejects_garbage_and_checksum_damage(codec: str) -> None:
    data = DATASETS["fp32"]
    payload = bytearray(encode(codec, memoryview(data), itemsize=4))
    out = memoryview(bytearray(len(data)))
    with pytest.raises(IntegrityError, match="corrupt"):
        decode(codec, memoryview(bytes(range(256)) * 4), len(data), out, itemsize=4)
    payload[-1] ^= 0x55  # the last 4 bytes are the frame's content checksum
    with pytest.raises(IntegrityError, match="corrupt"):
        decode(codec, memoryview(payload), len(data), out, itemsize=4)


@pytest.mark.parametrize("codec", [ZSTD, BGZSTD])
def test_no_single_byte_corruption_decodes_to_wrong_bytes(codec: str) -> None:
    # A flip may land in bits zstd never reads (so the output is still right), but it must never
    # yield different bytes: either the exact data or IntegrityError.
    data = _tensor_bytes(torch.bfloat16, 1024, 11)
    payload = encode(codec, memoryview(data), itemsize=2)
    detected = 0
    for pos in range(len(payload)):
        for mask in (0x01, 0xFF):
            damaged = bytearray(payload)
            damaged[pos] ^= mask
            out = bytearray(len(data))
            try:
                decode(codec, memoryview(damaged), len(data), memoryview(out), itemsize=2)
            except IntegrityError:
                detected += 1
                continue
            assert bytes(out) == data, (pos, mask)
    assert detected >= 2 * len(payload) - 8


# --- header -------------------------------------------------------------------------------------

HEADER = ChunkHeader(
    chunk_id=content_id(memoryview(DATASETS["fp32"])),
    raw_len=len(DATASETS["fp32"]),
    stored_len=len(encode(BGZSTD, memoryview(DATASETS["fp32"]), itemsize=4)),
    codec=BGZSTD,
    itemsize=4,
    hash_algo="xxh3-128",
)


def _forge(
    *,
    magic: bytes = b"TIERCHNK",
    version: int = 1,
    itemsize: int = 4,
    raw_len: int = 100,
    stored_len: int = 100,
    codec: bytes = b"raw/1",
    algo: bytes = b"xxh3-128",
    chunk_id: bytes = b"0" * 32,
) -> bytes:
    """Build a header with a valid CRC from the documented layout, bypassing write_header's checks."""
    buf = bytearray(HEADER_BYTES)
    struct.pack_into(
        "<8sHHQQ32s32s128s", buf, 0, magic, version, itemsize, raw_len, stored_len, codec, algo, chunk_id
    )
    struct.pack_into("<I", buf, HEADER_BYTES - 4, zlib.crc32(buf[: HEADER_BYTES - 4]))
    return bytes(buf)


@pytest.mark.parametrize("algo", ["xxh3-128", "blake2b"])
@pytest.mark.parametrize("codec", ALL_CODECS)
def test_header_roundtrip(codec: str, algo: str) -> None:
    data = DATASETS["fp16"]
    header = ChunkHeader(
        chunk_id=content_id(memoryview(data), algo),
        raw_len=len(data),
        stored_len=len(encode(codec, memoryview(data), itemsize=2)),
        codec=codec,
        itemsize=2,
        hash_algo=algo,
    )
    packed = pack_header(header)
    assert len(packed) == HEADER_BYTES
    assert read_header(packed) == header


def test_header_layout_matches_the_documented_format() -> None:
    packed = pack_header(HEADER)
    assert packed == _forge(
        itemsize=4,
        raw_len=HEADER.raw_len,
        stored_len=HEADER.stored_len,
        codec=b"bgzstd/1",
        algo=b"xxh3-128",
        chunk_id=HEADER.chunk_id.encode(),
    )
    assert packed[220 : HEADER_BYTES - 4] == bytes(HEADER_BYTES - 4 - 220)


def test_write_header_fills_exactly_the_header_of_a_larger_span() -> None:
    span = bytearray(b"\xaa" * (HEADER_BYTES + 512))
    write_header(memoryview(span), HEADER)
    assert bytes(span[:HEADER_BYTES]) == pack_header(HEADER)
    assert bytes(span[HEADER_BYTES:]) == b"\xaa" * 512
    assert read_header(memoryview(span)) == HEADER


def test_a_chunk_object_is_its_header_then_its_payload() -> None:
    data = bytes(range(256)) * 16
    cid = content_id(memoryview(data))
    raw = chunk_object(data, cid, "xxh3-128")
    assert read_header(memoryview(raw)) == ChunkHeader(cid, len(data), len(data), RAW, 1, "xxh3-128")
    assert bytes(raw[HEADER_BYTES:]) == data
    # Sealed in place (the arena, DCP's buffers): the same bytes.
    span = bytearray(HEADER_BYTES) + bytearray(data)
    seal_chunk(memoryview(span), cid, "xxh3-128")
    assert span == raw
    packed = encode(ZSTD, memoryview(data))
    zstd = chunk_object(packed, cid, "xxh3-128", codec=ZSTD, raw_len=len(data), itemsize=4)
    assert read_header(memoryview(zstd)) == ChunkHeader(cid, len(data), len(packed), ZSTD, 4, "xxh3-128")
    assert bytes(zstd[HEADER_BYTES:]) == packed


def test_header_from_a_numpy_page() -> None:
    page = np.zeros(HEADER_BYTES // 8, dtype=np.uint64)
    write_header(memoryview(page), HEADER)
    assert read_header(memoryview(page)) == HEADER


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_header_byte_flip_is_detected(mask: int) -> None:
    packed = pack_header(HEADER)
    for pos in range(HEADER_BYTES):
        damaged = bytearray(packed)
        damaged[pos] ^= mask
        with pytest.raises(IntegrityError):
            read_header(damaged)


def test_header_errors_name_the_problem() -> None:
    packed = pack_header(HEADER)
    with pytest.raises(IntegrityError, match="magic"):
        read_header(b"XIERCHNK" + packed[8:])
    with pytest.raises(IntegrityError, match="CRC"):
        read_header(packed[:300] + b"\x01" + packed[301:])
    with pytest.raises(IntegrityError, match="shorter than"):
        read_header(packed[:-1])
    with pytest.raises(IntegrityError, match="format version"):
        read_header(_forge(version=2))
    with pytest.raises(IntegrityError, match="unknown codec"):
        read_header(_forge(codec=b"lz4/1"))
    with pytest.raises(IntegrityError, match="unknown hash"):
        read_header(_forge(algo=b"md5"))
    with pytest.raises(IntegrityError, match="chunk id"):
        read_header(_forge(chunk_id=b"G" * 32))
    with pytest.raises(IntegrityError, match="itemsize"):
        read_header(_forge(itemsize=3))
    with pytest.raises(IntegrityError, match="absurd raw length"):
        read_header(_forge(raw_len=1 << 50, stored_len=1 << 50))
    with pytest.raises(IntegrityError, match="absurd stored length"):
        read_header(_forge(raw_len=100, stored_len=99))
    with pytest.raises(IntegrityError, match="absurd stored length"):
        read_header(_forge(codec=b"zstd/1", raw_len=100, stored_len=100_000))
    with pytest.raises(IntegrityError, match="NUL"):
        read_header(_forge(codec=b"raw\x00/1"))
    with pytest.raises(IntegrityError, match="ASCII"):
        read_header(_forge(algo=b"\xffxh3"))


def test_header_allows_every_length_a_codec_can_produce() -> None:
    assert read_header(_forge(codec=b"zstd/1", raw_len=0, stored_len=13)).stored_len == 13
    worst = len(encode(ZSTD, memoryview(DATASETS["random"]), level=1))
    header = ChunkHeader("0" * 32, len(DATASETS["random"]), worst, ZSTD, 1, "blake2b")
    assert read_header(pack_header(header)) == header


def test_write_header_refuses_what_it_cannot_store() -> None:
    with pytest.raises(ConfigError, match="unknown codec"):
        pack_header(ChunkHeader("0" * 32, 1, 1, "lz4/1", 1, "xxh3-128"))
    with pytest.raises(ConfigError, match="chunk id"):
        pack_header(ChunkHeader("0" * 33, 1, 1, RAW, 1, "xxh3-128"))
    with pytest.raises(ConfigError, match="stored length"):
        pack_header(ChunkHeader("0" * 32, 10, 11, RAW, 1, "xxh3-128"))
    with pytest.raises(ConfigError, match="needs 4096 bytes"):
        write_header(memoryview(bytearray(HEADER_BYTES - 1)), HEADER)


# --- content ids --------------------------------------------------------------------------------


def test_content_id_matches_the_reference_hashes() -> None:
    data = DATASETS["fp32"]
    assert content_id(memoryview(data)) == xxhash.xxh3_128(data).hexdigest()
    assert content_id(memoryview(data), "blake2b") == hashlib.blake2b(data, digest_size=16).hexdigest()
    assert content_id(memoryview(b"")) == "99aa06d3014798d86001c324468d497f"


@pytest.mark.parametrize("algo", ["xxh3-128", "blake2b"])
def test_content_id_is_stable_and_sensitive_to_one_bit(algo: str) -> None:
    data = DATASETS["bf16"]
    first = content_id(memoryview(data), algo)
    assert len(first) == 32
    assert content_id(memoryview(bytearray(data)), algo) == first
    assert content_id(memoryview(np.frombuffer(data, dtype=np.uint16)), algo) == first
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0x10
    assert content_id(memoryview(flipped), algo) != first


@pytest.mark.parametrize("algo", ["xxh3-128", "blake2b"])
def test_streamed_hash_of_any_split_is_the_content_id(algo: str) -> None:
    data = DATASETS["fp32"]
    for cuts in ([], [1], [4096, 4097, 70_001], list(range(0, len(data), 65_536))):
        h = hasher(algo)
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            h.update(memoryview(data)[a:b])
        assert h.hexdigest() == content_id(memoryview(data), algo)


def test_content_id_rejects_unknown_algorithms() -> None:
    with pytest.raises(ConfigError, match="unknown hash"):
        content_id(memoryview(b"x"), "md5")
    with pytest.raises(ConfigError, match="unknown hash algorithm 'md5'"):
        hasher("md5")
