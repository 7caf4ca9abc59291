"""tiercache: a tiered checkpoint cache for PyTorch training.

``save()`` snapshots a state dict into a RAM arena in the time of a memcpy and returns; the
checkpoint then moves to local disk and S3 in the background. Versions are content-addressed,
have parents, live on branches and can be tagged; ``restore()`` reads each chunk from the fastest
tier that holds a good copy.

Example:
    >>> import tiercache
    >>> cache = tiercache.open({"disk": {"path": "/tmp/ckpt"}})
    >>> h = cache.save({"w": torch.ones(3)}, step=1)
    >>> h.wait("local")
    >>> cache.restore("main")["w"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.errors import (
    AccessDeniedError,
    AgentUnavailableError,
    AmbiguousRefError,
    BranchNotFoundError,
    BucketNotFoundError,
    CacheClosedError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    GroupBrokenError,
    GroupSaveError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    LastCopyError,
    RefExistsError,
    SkippedError,
    StateMismatchError,
    StorageError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
    UnsupportedStateError,
    VersionNotFoundError,
)

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed import ProcessGroup

    from tiercache.cache import ConfigLike, MultiRank, TierCache
    from tiercache.config import CacheConfig, DiskConfig, PolicyConfig, RamConfig, S3Config, load_config
    from tiercache.core import CacheCore
    from tiercache.group import GroupView
    from tiercache.handle import SaveHandle
    from tiercache.manifest import RefMove, TierState, VersionInfo
    from tiercache.policy.base import Placement, Policy, PolicyContext, TierPlan, TierStats, VersionView

__version__ = "0.1.0"

#: Where each public name lives: imported on first use, so that `import tiercache` (and with it
#: `tiercache --help` or `tiercache ls`) pays only for what it touches, never for torch.
_HOME = {
    "TierCache": "cache",
    "CacheConfig": "config", "DiskConfig": "config", "PolicyConfig": "config", "RamConfig": "config",
    "S3Config": "config", "load_config": "config",
    "GroupView": "group",
    "SaveHandle": "handle",
    "RefMove": "manifest", "TierState": "manifest", "VersionInfo": "manifest",
    "Placement": "policy.base", "Policy": "policy.base", "PolicyContext": "policy.base", "TierPlan": "policy.base",
    "TierStats": "policy.base", "VersionView": "policy.base",
}


def open(config: ConfigLike = None) -> TierCache:
    """Open a cache.

    Args:
        config: A dict with the tables ``ram``, ``disk``, ``s3``, ``policy`` (any subset of the
            tiers), a path to a TOML file with the same tables, a :class:`CacheConfig`, or
            ``None`` to use the file named by ``TIERCACHE_CONFIG`` (or ``./tiercache.toml``).
            ``TIERCACHE_*`` environment variables add to it: what code gives (a dict, or the fields
            a :class:`CacheConfig` was built with) wins over the environment, which wins over a
            file; a variable that disagrees with the code or adds a tier to it is logged at WARNING.

    Returns:
        The open cache; use it as a context manager or call :meth:`TierCache.close`.

    Raises:
        ConfigError: If the config is invalid (the message names the field).
        BucketNotFoundError, TierUnavailableError, AccessDeniedError: If the S3 tier cannot be used.
    """
    from tiercache.cache import TierCache
    from tiercache.config import load_config

    return TierCache(load_config(config), group_views=_group_view)


def _group_view(cache: TierCache, core: CacheCore, group: ProcessGroup | None,
                timeout: timedelta | None) -> MultiRank:
    """The group view of ``cache`` and its core (made on first use: multi-rank code and torch.distributed load then)."""
    from tiercache.group import DEFAULT_TIMEOUT, GroupView

    return GroupView(cache, core, group, timeout=timeout or DEFAULT_TIMEOUT)


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"tiercache.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "AccessDeniedError",
    "AgentUnavailableError",
    "AmbiguousRefError",
    "BranchNotFoundError",
    "BucketNotFoundError",
    "CacheClosedError",
    "CacheConfig",
    "ConfigError",
    "ConflictError",
    "DeadlineExceededError",
    "DiskConfig",
    "GroupBrokenError",
    "GroupSaveError",
    "GroupView",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidNameError",
    "LastCopyError",
    "Placement",
    "Policy",
    "PolicyConfig",
    "PolicyContext",
    "RamConfig",
    "RefExistsError",
    "RefMove",
    "S3Config",
    "SaveHandle",
    "SkippedError",
    "StateMismatchError",
    "StorageError",
    "TierCache",
    "TierCacheError",
    "TierFullError",
    "TierPlan",
    "TierState",
    "TierStats",
    "TierUnavailableError",
    "UnsupportedStateError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionView",
    "__version__",
    "load_config",
    "open",
]
