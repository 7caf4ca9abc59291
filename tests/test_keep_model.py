"""A model test of the keep rule (docs/design.md section 3).

A hypothesis state machine drives random sequences of saves of random sizes (some below the chunk
packing threshold, some over several chunks), a disk ``capacity`` or none, an S3 tier behind a
link that is fast, slow or refusing connections, and process restarts (close, then a fresh
``TierCache`` on the same directories and bucket prefix). After every step it checks the rule
against a model of what was acknowledged: every version whose ``local``, ``remote`` or
``durable`` future resolved is listed and restores bit-exact. The default policy and retention
are used, so no rule the user set may delete anything.

Two examples of six steps in the default run (about 15 s); sixty of thirty with ``--slow``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tiercache
from tiercache.config import S3Config
from tiercache.errors import TierCacheError
from tiercache.testing import ThrottledProxy

KIB = 1 << 10
MIB = 1 << 20
#: Seconds S3 gets per request on a refusing link before the tier counts as down.
FAST = {"connect_timeout": 0.5, "read_timeout": 2.0, "probe_timeout": 0.5, "max_attempts": 2, "deadline_s": 10}
LEVELS = ("local", "remote", "durable")


def _state(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    """A small tensor (packed with others into one chunk) and one of ``nbytes`` (maybe several chunks)."""
    g = torch.Generator().manual_seed(seed)
    return {"small": torch.randn(256, generator=g), "big": torch.randn(max(1, nbytes // 4), generator=g)}


def _set_mode(proxy: ThrottledProxy, mode: str) -> None:
    """Set the link's mode; listening again right after a refusal may find the port still closing."""
    for _ in range(50):
        try:
            proxy.mode = mode  # type: ignore[assignment]
            return
        except OSError:
            time.sleep(0.05)
    proxy.mode = mode  # type: ignore[assignment]


def _machine(s3: S3Config, proxy: ThrottledProxy) -> type[RuleBasedStateMachine]:
    class KeepRule(RuleBasedStateMachine):
        """Saves, link changes and restarts; the acknowledged versions stay restorable."""

        def __init__(self) -> None:
            super().__init__()
            self.root = Path(tempfile.mkdtemp(prefix="tc-keep-model-"))
            self.prefix = f"{s3.url}-{uuid.uuid4().hex[:12]}"
            self.capacity: int | None = None
            _set_mode(proxy, "up")
            proxy.limit_bps = None
            self.seed = 0
            self.states: dict[str, dict[str, torch.Tensor]] = {}  # every version save() returned for
            self.handles: list[Any] = []  # of this process's saves
            self.acked: set[str] = set()  # versions a future promised: the model
            self.checked: set[str] = set()  # restored bit-exact since the last restart
            self.cache = self._open()

        def _open(self) -> Any:
            disk: dict[str, Any] = {"path": str(self.root / "disk")}
            if self.capacity is not None:
                disk["capacity"] = self.capacity
            cfg = {
                "ram": {"capacity": 32 * MIB},
                "disk": disk,
                "s3": s3.model_copy(update={"url": self.prefix, "endpoint_url": proxy.url, **FAST}).model_dump(),
                "chunk_bytes": "1MiB",
                "engine": {"probe_interval_s": 0.2},
            }
            return tiercache.open(cfg)

        # The first choices (what hypothesis tries first) are the hard case: a disk capacity and a slow link.
        @initialize(capacity=st.sampled_from([8 * MIB, 5 * MIB, None]), slow=st.sampled_from([True, False]))
        def start(self, capacity: int | None, slow: bool) -> None:
            self._close()
            self.capacity = capacity
            proxy.limit_bps = 2_000_000 if slow else None
            self.cache = self._open()

        @rule(sizes=st.lists(st.sampled_from([1536 * KIB, 900 * KIB, 2560 * KIB, 200 * KIB, 4 * KIB]),
                             min_size=2, max_size=8), gap=st.sampled_from([0.05, 0.0]))
        def save(self, sizes: list[int], gap: float) -> None:
            """A burst of saves, ``gap`` seconds apart (the slower tiers fall behind)."""
            for nbytes in sizes:
                self.seed += 1
                state = _state(self.seed, nbytes)
                h = self.cache.save(state, step=self.seed)
                self.states[h.version] = state
                self.handles.append(h)
                time.sleep(gap)

        @rule(link=st.sampled_from(["fast", "slow", "refuse"]))
        def set_link(self, link: str) -> None:
            _set_mode(proxy, "refuse" if link == "refuse" else "up")
            proxy.limit_bps = 2_000_000 if link == "slow" else None

        @rule(capacity=st.sampled_from([None, 5 * MIB, 8 * MIB]))
        def restart(self, capacity: int | None) -> None:
            self._close()
            self.capacity = capacity
            self.checked.clear()
            self.cache = self._open()
            self._check_all()

        @precondition(lambda self: bool(self.handles))
        @rule()
        def settle(self) -> None:
            """Wait for the ``local`` levels (a ``remote`` one may wait for a refusing link's catch-up)."""
            for h in self.handles:
                h.future("local").exception(timeout=60)

        def _close(self) -> None:
            with contextlib.suppress(TierCacheError):  # a version that reached no durable tier (none acked)
                self.cache.close()
            self._note_acked()
            self.handles = []

        def _note_acked(self) -> None:
            for h in self.handles:
                if any(h.future(lvl).done() and h.future(lvl).exception() is None for lvl in LEVELS):
                    self.acked.add(h.version)

        def _check_all(self) -> None:
            listed = {v.id for v in self.cache.versions()}
            lost = self.acked - listed
            assert not lost, f"acknowledged versions not listed: {sorted(lost)}"
            for vid in sorted(self.acked - self.checked):
                back = self.cache.restore(vid)
                want = self.states[vid]
                assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want), vid
                self.checked.add(vid)

        @invariant()
        def acknowledged_versions_stay_restorable(self) -> None:
            self._note_acked()
            self._check_all()

        def teardown(self) -> None:
            try:
                _set_mode(proxy, "up")
                proxy.limit_bps = None
                self._close()
                self.checked.clear()
                self.cache = self._open()  # a last restart: everything acknowledged is still there
                self._check_all()
                self.cache.close()
            finally:
                shutil.rmtree(self.root, ignore_errors=True)

    return KeepRule


def test_the_keep_rule_holds_over_random_saves_links_capacities_and_restarts(
    s3_config: S3Config, s3_server: Any, slow: bool
) -> None:
    with ThrottledProxy(s3_server.endpoint_url) as proxy:
        run_state_machine_as_test(
            _machine(s3_config, proxy),
            settings=settings(max_examples=60 if slow else 2, stateful_step_count=30 if slow else 6,
                              deadline=None, suppress_health_check=list(HealthCheck), derandomize=not slow),
        )
