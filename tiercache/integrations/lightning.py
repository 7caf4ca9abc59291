"""A Lightning ``CheckpointIO`` plugin: Lightning checkpoints saved and loaded through tiercache.

Usage (needs the ``lightning`` extra)::

    trainer = Trainer(plugins=[TierCacheCheckpointIO(cache)], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    trainer.fit(model)                                   # every checkpoint is a tiercache version
    trainer.fit(model, ckpt_path="ckpt/epoch=0-step=8.ckpt")   # resume from the version saved for that path

``save_checkpoint`` hands Lightning's checkpoint dict to ``cache.save`` (it returns after the
memcpy; the version reaches disk and S3 in the background) as a version at the checkpoint's
``global_step``, recording the absolute path Lightning chose in the version's
``meta["lightning_path"]``; nothing is written at that path. ``load_checkpoint`` restores the
newest version saved for that path (relative or absolute, as ``ckpt_path`` gives it), or, for a
path no version records, treats the string as a tiercache ref (``main``, ``main@1000``, a tag, a
version id); a path that is neither is a :class:`~tiercache.errors.VersionNotFoundError` naming
it. ``remove_checkpoint`` (Lightning's top-k cleanup) keeps the version: retention is the cache
policy's job. ``teardown`` waits until every save is durable.

Lightning checkpoints hold plain values (loop counters, callback states, hyper-parameters); a
leaf that is neither a tensor nor a plain value (an ``argparse.Namespace`` of hyper-parameters,
say) needs ``allow_pickle = true`` in the cache config, as with any ``save``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.io import CheckpointIO

from tiercache.errors import InvalidNameError, VersionNotFoundError
from tiercache.handle import Level
from tiercache.manifest import parse_ref

if TYPE_CHECKING:
    from tiercache.cache import TierCache

log = logging.getLogger("tiercache.integrations.lightning")

#: The ``meta`` key naming the path Lightning saved a version under.
PATH_KEY = "lightning_path"


class TierCacheCheckpointIO(CheckpointIO):
    """Lightning checkpoint I/O through a :class:`~tiercache.cache.TierCache`.

    Args:
        cache: The cache (one per process; with several ranks, Lightning saves on rank 0 only,
            as with its default I/O).
        branch: The branch checkpoints are saved on.
        wait: A durability level to wait for before ``save_checkpoint`` returns (``None``:
            return after the memcpy).
    """

    def __init__(self, cache: TierCache, *, branch: str = "main", wait: Level | None = None) -> None:
        self.cache = cache
        self.branch = branch
        self.wait = wait

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as a version at its ``global_step``, recording ``path``."""
        # Absolute, so that a resume from another working directory, or naming the path relative
        # to this one, finds it.
        meta = {PATH_KEY: os.path.realpath(os.fspath(path)), "epoch": int(checkpoint.get("epoch", 0))}
        handle = self.cache.save(checkpoint, step=int(checkpoint.get("global_step", 0)), branch=self.branch,
                                 meta=meta)
        if self.wait is not None:
            handle.wait(self.wait)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Restore the newest version saved for ``path`` (or the ref ``path`` names).

        Raises:
            VersionNotFoundError: If no version was saved for ``path`` and it is no ref either; the
                message names the path and the paths checkpoints were saved under.
        """
        target = os.fspath(path)
        wanted = os.path.realpath(target)
        versions = [v for v in self.cache.versions() if isinstance(v.meta.get(PATH_KEY), str)]
        saved = [v.id for v in versions if os.path.realpath(v.meta[PATH_KEY]) == wanted]
        if saved:
            return self.cache.restore(saved[-1], map_location=map_location or "cpu")
        try:
            parse_ref(target)
            return self.cache.restore(target, map_location=map_location or "cpu")
        except (InvalidNameError, VersionNotFoundError):
            known = [v.meta[PATH_KEY] for v in versions[-3:]]
            raise VersionNotFoundError(
                f"no tiercache version was saved for checkpoint {target!r} ({wanted}), and it is no ref either: "
                f"pass a path a checkpoint was saved under ({', '.join(known) or 'none saved yet'}) or a ref "
                "such as 'main' or 'main@STEP'; `tiercache ls` lists the versions"
            ) from None

    def remove_checkpoint(self, path: Any) -> None:
        """Keep the version (retention is the cache policy's job); only log the request."""
        log.debug("Lightning asked to remove checkpoint %s: kept (retention is the cache policy's job)", path)

    def teardown(self) -> None:
        """Wait until every pending save has finished on every tier."""
        self.cache.flush()
