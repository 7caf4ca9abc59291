"""A listing page of ``ListObjectsV2`` read for the fields the tier uses, not by botocore's per-field walk.

botocore parses a response by walking the operation's output shape field by field in Python:
for a page of 1,000 objects that is about 6,000 shape visits, 0.1 s of the 2-core VM of
docs/benchmarks.md, which was most of what an S3 open of a 1,000-version history spent beyond a
1-version one (the catalog lists every manifest's name at each open; the listing is the truth).

:func:`register` hooks ``before-parse`` of ``ListObjectsV2``: the objects of a successful page are
read (:func:`read_objects`) into ``Key``, ``Size`` and ``LastModified`` and taken out of the body,
which botocore then parses for the rest (the continuation token, the truncation flag, the
encoding type). Everything else of botocore's handling stays: retries, errors, and the
URL-decoding of the keys (``EncodingType=url``, which botocore asks for and undoes after the
parse). An object's other fields (``ETag``, ``StorageClass``, ``Owner``) are not returned. A page
the fast path cannot read is left to botocore whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

_OBJECT = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_FIELD = re.compile(rb"<(Key|Size|LastModified)>([^<]*)</\1>")
_ENTITY = re.compile(r"&(#[0-9]+|#x[0-9a-fA-F]+|amp|lt|gt|quot|apos);")
_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


def _char(m: re.Match[str]) -> str:
    ref = m.group(1)
    if ref in _NAMED:
        return _NAMED[ref]
    code = int(ref[2:], 16) if ref[1] == "x" else int(ref[1:])
    if code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or 0x10000 <= code <= 0x10FFFF:
        return chr(code)
    raise ValueError(f"not an XML character: &{ref};")


def _text(raw: bytes) -> str:
    """The text of an element: UTF-8 with XML's five entities and character references resolved."""
    text = raw.decode()
    if "&" not in text:
        return text
    out = _ENTITY.sub(_char, text)
    if "&" in _ENTITY.sub("", text):
        raise ValueError("an entity XML does not define")
    return out


def read_objects(body: bytes, timestamp: Callable[[str], datetime]) -> list[dict[str, Any]] | None:
    """The objects of a ``ListObjectsV2`` page: ``Key`` (as sent), ``Size`` and ``LastModified``.

    A page is a fixed machine format: each object a ``<Contents>`` element of flat text fields.
    It is read with two regular expressions (a C-level XML parse of the page took 14 ms for 1,000
    objects; this takes under 10 ms, most of it making the dicts and times).

    Returns:
        One dict per ``Contents`` element in page order (a field the page lacks is left out, as
        botocore leaves it out), or ``None`` if the page is not in the plain form this reads:
        no listing root, a ``CDATA`` section or a carriage return (an XML parser rewrites line
        ends), an element written another way than ``<Contents>...</Contents>``, an object with
        other than one key, or a field it cannot read. botocore then parses the page, and
        reports what is wrong with it.
    """
    if b"<ListBucketResult" not in body or b"<![CDATA[" in body or b"\r" in body:
        return None
    blocks = _OBJECT.findall(body)
    if body.count(b"<Contents") != len(blocks) or body.count(b"</Contents") != len(blocks):
        return None
    out = []
    try:
        for block in blocks:
            found = _FIELD.findall(block)
            keys = [v for f, v in found if f == b"Key"]
            if len(keys) != 1 or block.count(b"<Key") != 1:
                return None
            fields = dict(found)
            obj: dict[str, Any] = {"Key": _text(keys[0])}
            if b"Size" in fields:
                obj["Size"] = int(fields[b"Size"])
            if b"LastModified" in fields:
                obj["LastModified"] = timestamp(_text(fields[b"LastModified"]))
            out.append(obj)
    except ValueError:  # a size, time or character it cannot read, or bytes that are not UTF-8
        return None
    return out


def register(events: Any, timestamp: Callable[[str], datetime]) -> None:
    """Read ``ListObjectsV2`` pages with :func:`read_objects` on a botocore session's event system."""

    def before_parse(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
        body = response_dict.get("body")
        if response_dict.get("status_code") != 200 or not isinstance(body, bytes | bytearray):
            return
        objects = read_objects(bytes(body), timestamp)
        if objects is None:
            return
        rest = _OBJECT.sub(b"", bytes(body))
        if b"<Contents" in rest:  # an object in a form the pattern missed: botocore parses the page
            return
        response_dict["body"] = rest
        if objects:
            customized_response_dict["Contents"] = objects

    events.register("before-parse.s3.ListObjectsV2", before_parse, unique_id="tiercache-fast-listing")
