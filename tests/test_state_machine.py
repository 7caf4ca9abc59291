"""A hypothesis state machine over save/restore/branch/rollback/tag/evict/reopen/gc against an in-memory model.

After every step the cache's refs, every version's parent and the restored bytes of every ref
equal the model's. A restore is a resume: the next save on that version's branch continues from
it; a save on a new branch starts from what the process last saved or restored.

Saves may stay pending: ``hold`` stops the disk writer right after it leased the chunks of the
version it writes (the ``repo.after_claim`` failpoint), so the saves that follow queue behind it
while evict, gc, rollback, branch, tag and restore run; ``settle`` lets them all finish, and each
must then reach ``local`` as the version it was staged as. The process's view (refs, parents,
bytes) already includes a staged version, so the invariant holds while saves are pending too; a
reopen settles first and then checks what the disk holds. States take few distinct values, so
saves deduplicate against chunks that gc or evict may be deleting at that moment.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tiercache
from tiercache import failpoints
from tiercache.errors import ConflictError, InvalidArgumentError
from tiercache.handle import SaveHandle

BRANCHES = ("main", "dev", "ft")
TAGS = ("best", "v1")
VALUES = st.integers(0, 4)  # few distinct states: saves deduplicate against existing chunks
HOLD_S = 60.0  # the longest a held writer waits: a liveness bound, never reached when the test passes


def _state(value: int) -> dict[str, Any]:
    return {"w": torch.full((300,), float(value)), "b": torch.arange(5) * value, "value": value}


class CacheModel(RuleBasedStateMachine):
    """The cache against dicts: refs (``branch/x``, ``tag/x`` -> id), parents and values per version."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tc-sm-")
        self.cfg = {"ram": {"capacity": "8MiB"}, "disk": {"path": self.dir}, "policy": {"name": "write-through"},
                    "reflog_keep": 0}
        self.cache = tiercache.open(self.cfg)
        self.go = threading.Event()  # clear: the disk writer stops after its next claim
        self.go.set()
        self.hooks = contextlib.ExitStack()
        self.hooks.enter_context(failpoints.hooked("repo.after_claim", self._disk_claimed))
        self.pending: list[tuple[SaveHandle, str]] = []
        self.refs: dict[str, str] = {}
        self.parents: dict[str, str | None] = {}
        self.values: dict[str, int] = {}
        self.branch_of: dict[str, str] = {}
        self.resumed: dict[str, str] = {}  # per branch: what this process restored from it
        self.last: str | None = None  # what this process last saved or restored
        self.step = 0

    def _disk_claimed(self, tier: str, missing: set[str]) -> None:
        if tier == "disk" and not self.go.is_set():
            assert self.go.wait(HOLD_S), "the held disk writer was never let go"

    def teardown(self) -> None:
        self.go.set()
        try:
            self.cache.close()
        finally:
            self.hooks.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: self.go.is_set())
    @rule()
    def hold(self) -> None:
        self.go.clear()

    @precondition(lambda self: not self.go.is_set())
    @rule()
    def settle(self) -> None:
        self.go.set()
        for handle, vid in self.pending:
            assert handle.wait("local") == vid
        self.pending.clear()

    @rule(branch=st.sampled_from(BRANCHES), value=VALUES)
    def save(self, branch: str, value: int) -> None:
        self.step += 1
        handle = self.cache.save(_state(value), step=self.step, branch=branch)
        vid = handle.version
        if self.go.is_set():  # not held: waited for, so "pending" in the model means held for sure
            assert handle.wait("local") == vid
        else:
            self.pending.append((handle, vid))
        head = self.refs.get(f"branch/{branch}")
        resumed = self.resumed.pop(branch, None)
        self.parents[vid] = self.last if head is None else resumed if resumed not in (None, head) else head
        self.values[vid] = value
        self.branch_of[vid] = branch
        self.refs[f"branch/{branch}"] = vid
        self.last = vid

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        ref = data.draw(st.sampled_from(sorted([*self.values, *(k.split("/")[1] for k in self.refs)])))
        vid = self.refs.get(f"branch/{ref}") or self.refs.get(f"tag/{ref}") or ref
        assert self.cache.restore(ref)["value"] == self.values[vid]
        branch = ref if f"branch/{ref}" in self.refs else self.branch_of[vid]
        self.resumed[branch] = vid
        self.last = vid

    def _targets(self) -> list[str]:
        """Versions a ref may be moved to now: a move waits for its version's write, so not a held one."""
        held = set() if self.go.is_set() else {vid for _, vid in self.pending}
        return sorted(set(self.values) - held)

    @precondition(lambda self: self._targets())
    @rule(name=st.sampled_from(BRANCHES), data=st.data())
    def branch(self, name: str, data: st.DataObject) -> None:
        vid = data.draw(st.sampled_from(self._targets()))
        if f"branch/{name}" in self.refs:
            with pytest.raises(ConflictError):
                self.cache.branch(name, vid)
            return
        assert self.cache.branch(name, vid) == vid
        self.refs[f"branch/{name}"] = vid

    @precondition(lambda self: any(k.startswith("branch/") for k in self.refs) and self._targets())
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k in self.refs if k.startswith("branch/"))))
        vid = data.draw(st.sampled_from(self._targets()))
        history, cur = set(), self.refs[key]
        while cur is not None and cur not in history:
            history.add(cur)
            cur = self.parents.get(cur)
        branch = key.split("/")[1]
        if vid not in history:  # not back: refused, unless the move is asked for as a reset
            with pytest.raises(InvalidArgumentError, match=f"^rollback {branch}: "):
                self.cache.rollback(branch, vid)
            assert self.cache.rollback(branch, vid, reset=True) == vid
        else:
            assert self.cache.rollback(branch, vid) == vid
        self.refs[key] = vid
        self.resumed.pop(key.split("/")[1], None)

    @precondition(lambda self: self._targets())
    @rule(name=st.sampled_from(TAGS), data=st.data())
    def tag(self, name: str, data: st.DataObject) -> None:
        vid = data.draw(st.sampled_from(self._targets()))
        cur = self.refs.get(f"tag/{name}")
        if cur is not None and cur != vid:
            with pytest.raises(ConflictError):
                self.cache.tag(name, vid)
            return
        assert self.cache.tag(name, vid) == vid
        self.refs[f"tag/{name}"] = vid

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def evict_from_ram(self, data: st.DataObject) -> None:
        self.cache.evict(data.draw(st.sampled_from(sorted(self.values))), "ram")

    @rule()
    def reopen(self) -> None:
        self.settle()  # close() waits for every pending save: a held writer would never let it
        self.cache.close()
        self.cache = tiercache.open(self.cfg)
        self.resumed, self.last = {}, None

    @rule()
    def gc(self) -> None:
        self.cache.gc(grace=0)
        # A version still being written is never collected (its chunks are leased), nor what it
        # builds on; once committed off every ref it is garbage for the next gc.
        live: set[str] = set()
        for vid in [*self.refs.values(), *(vid for _, vid in self.pending)]:
            cur: str | None = vid
            while cur is not None and cur not in live:
                live.add(cur)
                cur = self.parents[cur]
        for vid in set(self.values) - live:
            del self.values[vid], self.parents[vid], self.branch_of[vid]
            self.resumed = {b: v for b, v in self.resumed.items() if v != vid}
            if self.last == vid:
                self.last = None

    @invariant()
    def matches_the_model(self) -> None:
        assert self.cache.refs() == self.refs
        assert {v.id: v.parent for v in self.cache.versions()} == self.parents
        for key, vid in self.refs.items():
            # Only reading (resume=False): checking every ref must not make this process resume.
            got = self.cache.restore(key.split("/")[1], resume=False)  # branch and tag names never clash here
            want = _state(self.values[vid])
            assert got["value"] == want["value"]
            assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])


def test_cache_matches_the_model(slow: bool) -> None:
    machine = settings(
        max_examples=60 if slow else 25, stateful_step_count=30 if slow else 20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(CacheModel)
    machine.TestCase().runTest()
