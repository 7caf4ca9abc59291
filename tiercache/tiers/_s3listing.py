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

import html
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

_OBJECT = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_FIELD = re.compile(rb"<(Key|Size|LastModified)>([^<]*)</\1>")


def _text(raw: bytes) -> str:
    text = raw.decode()
    return html.unescape(text) if "&" in text else text  # XML's character references


def read_objects(body: bytes, timestamp: Callable[[str], datetime]) -> list[dict[str, Any]] | None:
    """The objects of a ``ListObjectsV2`` page: ``Key`` (as sent), ``Size`` and ``LastModified``.

    A page is a fixed machine format: each object a ``<Contents>`` element of flat text fields.
    It is read with two regular expressions (a C-level XML parse of the page took 14 ms for 1,000
    objects; this takes under 3 ms).

    Returns:
        One dict per ``Contents`` element in page order, or ``None`` if the page is not in the
        plain form this reads (no listing root, a ``CDATA`` section, an object without a key or
        with a field it cannot read): botocore then parses it, and reports what is wrong.
    """
    if b"<ListBucketResult" not in body or b"<![CDATA[" in body:
        return None
    out = []
    try:
        for block in _OBJECT.findall(body):
            fields = dict(_FIELD.findall(block))
            key = fields.get(b"Key")
            if key is None:
                return None
            obj: dict[str, Any] = {"Key": _text(key), "Size": int(fields.get(b"Size") or 0)}
            if b"LastModified" in fields:
                obj["LastModified"] = timestamp(_text(fields[b"LastModified"]))
            out.append(obj)
    except ValueError:  # a size or a time it cannot read, or bytes that are not UTF-8
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
