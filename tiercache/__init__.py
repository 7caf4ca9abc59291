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
    from tiercache.cache import TierCache, open
    from tiercache.config import CacheConfig, DiskConfig, PolicyConfig, RamConfig, S3Config, load_config
    from tiercache.distributed import DistributedCache
    from tiercache.handle import SaveHandle
    from tiercache.manifest import RefMove, TierState, VersionInfo
    from tiercache.policy.base import Placement, Policy, PolicyContext, TierPlan, TierStats, VersionView

__version__ = "0.1.0"

#: Where each public name lives: imported on first use, so that `import tiercache` (and with it
#: `tiercache --help` or `tiercache ls`) pays only for what it touches, never for torch.
_HOME = {
    "TierCache": "cache", "open": "cache",
    "CacheConfig": "config", "DiskConfig": "config", "PolicyConfig": "config", "RamConfig": "config",
    "S3Config": "config", "load_config": "config",
    "DistributedCache": "distributed",
    "SaveHandle": "handle",
    "RefMove": "manifest", "TierState": "manifest", "VersionInfo": "manifest",
    "Placement": "policy.base", "Policy": "policy.base", "PolicyContext": "policy.base", "TierPlan": "policy.base",
    "TierStats": "policy.base", "VersionView": "policy.base",
}


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
    "DistributedCache",
    "GroupSaveError",
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
