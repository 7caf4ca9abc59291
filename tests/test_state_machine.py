"""A hypothesis state machine over save/restore/branch/rollback/tag/evict/reopen/gc against an in-memory model.

After every step the cache's refs, every version's parent and the restored bytes of every ref
equal the model's. A restore is a resume: the next save on that version's branch continues from
it; a save on a new branch starts from what the process last saved or restored.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tiercache
from tiercache.errors import ConflictError

BRANCHES = ("main", "dev", "ft")
TAGS = ("best", "v1")


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
        self.refs: dict[str, str] = {}
        self.parents: dict[str, str | None] = {}
        self.values: dict[str, int] = {}
        self.branch_of: dict[str, str] = {}
        self.resumed: dict[str, str] = {}  # per branch: what this process restored from it
        self.last: str | None = None  # what this process last saved or restored
        self.step = 0

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(branch=st.sampled_from(BRANCHES), value=st.integers(-1000, 1000))
    def save(self, branch: str, value: int) -> None:
        self.step += 1
        vid = self.cache.save(_state(value), step=self.step, branch=branch).wait("local")
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

    @precondition(lambda self: self.values)
    @rule(name=st.sampled_from(BRANCHES), data=st.data())
    def branch(self, name: str, data: st.DataObject) -> None:
        vid = data.draw(st.sampled_from(sorted(self.values)))
        if f"branch/{name}" in self.refs:
            with pytest.raises(ConflictError):
                self.cache.branch(name, vid)
            return
        assert self.cache.branch(name, vid) == vid
        self.refs[f"branch/{name}"] = vid

    @precondition(lambda self: any(k.startswith("branch/") for k in self.refs))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k in self.refs if k.startswith("branch/"))))
        vid = data.draw(st.sampled_from(sorted(self.values)))
        assert self.cache.rollback(key.split("/")[1], vid) == vid
        self.refs[key] = vid
        self.resumed.pop(key.split("/")[1], None)

    @precondition(lambda self: self.values)
    @rule(name=st.sampled_from(TAGS), data=st.data())
    def tag(self, name: str, data: st.DataObject) -> None:
        vid = data.draw(st.sampled_from(sorted(self.values)))
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
        self.cache.close()
        self.cache = tiercache.open(self.cfg)
        self.resumed, self.last = {}, None

    @rule()
    def gc(self) -> None:
        self.cache.gc(grace=0)
        live: set[str] = set()
        for vid in self.refs.values():
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
        max_examples=60 if slow else 15, stateful_step_count=30 if slow else 15, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(CacheModel)
    machine.TestCase().runTest()
