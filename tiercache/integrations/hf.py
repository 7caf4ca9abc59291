"""A Hugging Face ``TrainerCallback``: every Trainer checkpoint also stored as a tiercache version.

Usage (needs the ``hf`` extra)::

    trainer = Trainer(..., callbacks=[TierCacheCallback(cache)])
    trainer.train()                                   # checkpoint-N dirs -> versions at step N
    path = restore_checkpoint(cache, "main@300", "restored")   # a checkpoint dir again
    trainer.train(resume_from_checkpoint=str(path))

The Trainer writes a checkpoint as a directory of files whose formats it owns (weights,
optimizer, scheduler, RNG states, ``trainer_state.json``) and resumes from exactly those files.
So :class:`TierCacheCallback` stores that directory: in ``on_save`` (called once the Trainer has
written ``checkpoint-<global_step>``), on the world's main process, each file becomes a uint8
tensor of a version saved at ``global_step`` with ``meta["hf_checkpoint"]`` naming the directory.
The version moves to disk and S3 in the background, and chunks of files that did not change (a
frozen base model's weights) are stored once. :func:`restore_checkpoint` writes such a version
back as a checkpoint directory, byte for byte, for ``resume_from_checkpoint``; the local copies
can then be rotated away (``save_total_limit``) without losing any checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tiercache.cache import core_of
from tiercache.errors import InvalidArgumentError
from tiercache.handle import Level
from tiercache.names import check_name

if TYPE_CHECKING:
    from tiercache.cache import TierCache

#: The ``meta`` key naming the checkpoint directory a version holds.
DIR_KEY = "hf_checkpoint"


def _file_tensor(path: Path) -> torch.Tensor:
    data = bytearray(path.read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class TierCacheCallback(TrainerCallback):
    """Stores each checkpoint directory the Trainer writes as a tiercache version.

    Args:
        cache: The cache.
        branch: The branch checkpoints are saved on.
        wait: A durability level to wait for in ``on_save`` (``None``: return after the memcpy).
    """

    def __init__(self, cache: TierCache, *, branch: str = "main", wait: Level | None = None) -> None:
        check_name(branch, "branch")
        self.cache = cache
        self.branch = branch
        self.wait = wait

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Save the checkpoint directory just written (on the world's main process only)."""
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        files = {p.relative_to(directory).as_posix(): _file_tensor(p)
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        handle = self.cache.save({"files": files}, step=state.global_step, branch=self.branch,
                                 meta={DIR_KEY: directory.name})
        if self.wait is not None:
            handle.wait(self.wait)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Wait until every checkpoint saved during training is on every tier."""
        self.cache.flush()


def restore_checkpoint(cache: TierCache, ref: str, directory: str | os.PathLike[str]) -> Path:
    """Write the checkpoint version ``ref`` resolves to as a Trainer checkpoint directory.

    Args:
        cache: The cache.
        ref: A ref: ``main``, ``main@300`` (the checkpoint of step 300), a tag, a version id.
        directory: Where to create the ``checkpoint-<step>`` directory.

    The process resumes from that version: the next checkpoint :class:`TierCacheCallback` saves
    on its branch names it as parent, and the branch moves there (see ``TierCache.restore``).

    Returns:
        The checkpoint directory, for ``trainer.train(resume_from_checkpoint=...)``.

    Raises:
        InvalidArgumentError: If the version was not saved by :class:`TierCacheCallback`.
    """
    version = cache.manifest(ref)
    name = version.meta.get(DIR_KEY)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"version {version.id} is not a Trainer checkpoint (no meta[{DIR_KEY!r}])")
    check_name(name, "checkpoint directory")
    out = Path(directory) / name
    core = core_of(cache)
    for rel, data in core.restore_version(version)["files"].items():
        target = (out / rel).resolve()
        if not target.is_relative_to(out.resolve()):
            raise InvalidArgumentError(f"version {version.id} names a file outside its checkpoint: {rel!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.numpy().tobytes())
    core.note_restored(ref, version)
    return out
