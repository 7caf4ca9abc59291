"""A trainer process for the node agent's tests (run as a script: ``python _agent_trainer.py SPEC_JSON``).

It opens the cache of ``spec["config"]``, saves ``state_for(step)`` for each step of
``spec["steps"]`` and prints ``staged <step> <version>`` once ``save()`` returned (and
``<level> <step> <version>`` for each level of ``spec["wait"]`` once reached), flushed, so the
test knows exactly what was acknowledged. Then, per ``spec["end"]``:

``kill``     SIGKILL itself, as a crash would (nothing is flushed or closed);
``close``    close the cache (waits for every level) and exit 0;
``midcopy``  save one more version and SIGKILL itself halfway through its copy into the arena.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _crash_child import state_for

import tiercache
from tiercache.pipeline import staging


def _ack(*words: object) -> None:
    """Print one line in one write: the tests SIGKILL this process at any moment, and print() under
    PYTHONUNBUFFERED writes each word apart, so a kill could leave a torn line for the test to read."""
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def main(spec: dict) -> None:
    cache = tiercache.open(spec["config"])
    big = int(spec.get("big", 0))
    for step in spec["steps"]:
        h = cache.save(state_for(step, big), step=step)
        _ack("staged", step, h.version)
        for level in spec.get("wait", ()):
            h.wait(level)
            _ack(level, step, h.version)
    end = spec.get("end", "close")
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "midcopy":
        real = staging._memmove
        copied = [0]

        def half_then_die(dst: int, src: int, n: int) -> None:
            real(dst, src, n // 2)
            copied[0] += 1
            if copied[0] >= 2:  # some chunks whole, this one half: then the power goes
                os.kill(os.getpid(), signal.SIGKILL)
            real(dst + n // 2, src + n // 2, n - n // 2)

        staging._memmove = half_then_die
        step = spec["steps"][-1] + 1
        cache.save(state_for(step, big), step=step)
        print("unreachable", flush=True)
    cache.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
