"""Pausing Python's cyclic garbage collector while a large object graph is built.

Parsing the manifest of a state of 100k tensors makes a few hundred thousand lists and dicts, and
a restore into 100k tensors makes lists of them: every 700 allocations the collector walks the
young objects (all of which survive), and older generations in turn, so in a process that has
imported torch (a quarter of a million objects) the collections took about as long as the parse
itself (``json.loads`` of the object tree of such a manifest: 140 ms, 83 ms without them; the
whole manifest 261 ms against 142 ms; docs/benchmarks.md, "Many small tensors"). None of the
objects made there can be part of a cycle that needs collecting meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off automatic collections inside the block (nests, and across threads).

    The collector is enabled again when the last block open in the process ends, and only if it
    was enabled when the first one began: a program that disabled it keeps it disabled.
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
