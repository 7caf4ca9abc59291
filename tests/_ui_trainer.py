"""A trainer for the UI's browser test (run as a script, never imported by pytest).

``python _ui_trainer.py CONFIG`` saves to the cache of CONFIG in two phases, each ended by a line
``phase1 <ids>`` / ``phase2 <ids>`` on stdout (the ids as JSON); its status follows within
``ui.status_interval``:

1. main@1..3 are saved (each waited to ``local``), then an advisor sees steps 4..10 without a
   save: training is 7 steps ahead of the newest local version.
2. on a ``go`` line on stdin: branch ``finetune`` off main@2 with one save, tag ``best`` at
   main@3, main@11 and main@12, a rollback of main to main@11, main@13, and the advisor at step
   13: nothing is behind training any more.

It closes the cache on a ``stop`` line (or end of input).
"""

from __future__ import annotations

import json
import sys

import torch

import tiercache


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"layer.weight": torch.randn(256, 64, generator=g), "layer.bias": torch.full((64,), float(step))}


def main() -> None:
    cache = tiercache.open(sys.argv[1])
    ids = [cache.save(state(s), step=s, meta={"loss": 1.0 / s}).wait("local") for s in (1, 2, 3)]
    advisor = cache.advisor()
    for step in range(4, 11):
        advisor.should_save(step)  # only to report the training step: this phase never saves
    print("phase1", json.dumps(ids), flush=True)
    if sys.stdin.readline().strip() != "go":
        cache.close()
        return
    cache.branch("finetune", "main@2")
    ids.append(cache.save(state(103), step=3, branch="finetune").wait("local"))
    cache.tag("best", "main@3")
    ids += [cache.save(state(s), step=s).wait("local") for s in (11, 12)]
    cache.rollback("main", "main@11")
    ids.append(cache.save(state(13), step=13).wait("local"))
    advisor.should_save(13)
    print("phase2", json.dumps(ids), flush=True)
    sys.stdin.readline()
    cache.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
