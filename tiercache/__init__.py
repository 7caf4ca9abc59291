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

from tiercache.cache import TierCache, open
from tiercache.config import CacheConfig, DiskConfig, PolicyConfig, RamConfig, S3Config, load_config
from tiercache.errors import (
    AccessDeniedError,
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
from tiercache.handle import SaveHandle
from tiercache.manifest import RefMove, TierState, VersionInfo
from tiercache.policy.base import Placement, Policy, PolicyContext, TierPlan, TierStats, VersionView

if TYPE_CHECKING:
    from tiercache.distributed import DistributedCache

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # DistributedCache needs torch.distributed: imported on first use, so that `import tiercache`
    # (and `tiercache ls`) never pays for torch.
    if name == "DistributedCache":
        from tiercache.distributed import DistributedCache

        return DistributedCache
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")

__all__ = [
    "AccessDeniedError",
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
