"""The whole tiercache exception tree.

Every error tiercache raises derives from :class:`TierCacheError` and also from the builtin
exception a caller would naturally catch (``LookupError`` for a missing version, ``OSError`` for a
full tier, ``ValueError`` for bad configuration). Errors from S3 or the OS are mapped onto this
tree with the original kept as ``__cause__``; callers never need to match message strings.
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Root of every error raised by tiercache."""


class ConfigError(TierCacheError, ValueError):
    """The configuration (dict, TOML file or TIERCACHE_* variable) is invalid."""


class InvalidArgumentError(TierCacheError, ValueError):
    """An argument has the wrong type or value (a non-int step, non-JSON meta, unknown level)."""


class InvalidNameError(TierCacheError, ValueError):
    """A branch, tag, version id or key does not match ``[A-Za-z0-9._-]{1,128}``."""


class UnsupportedStateError(TierCacheError, TypeError):
    """A state-dict leaf cannot be stored safely (and pickle was not opted into)."""


class VersionNotFoundError(TierCacheError, LookupError):
    """A ref, branch, tag or version id does not resolve to a stored version."""


class BranchNotFoundError(VersionNotFoundError):
    """A branch that must exist (to be moved or listed) does not.

    Attributes:
        branch: The branch name.
    """

    def __init__(self, message: str, *, branch: str) -> None:
        super().__init__(message)
        self.branch = branch

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild, (type(self), str(self), {"branch": self.branch})


class AmbiguousRefError(TierCacheError, LookupError):
    """A version id prefix matches more than one version."""


class ConflictError(TierCacheError):
    """A compare-and-swap on a ref lost: somebody else moved it (or the tag already exists)."""


class RefExistsError(ConflictError):
    """A branch or tag cannot be created under this name: it exists (bad input, not a lost race).

    Attributes:
        kind: ``"branch"`` or ``"tag"``.
        name: The ref's name.
        version: The version it points at.
    """

    def __init__(self, message: str, *, kind: str, name: str, version: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.version = version

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild, (type(self), str(self), {"kind": self.kind, "name": self.name, "version": self.version})


class IntegrityError(TierCacheError):
    """Stored bytes do not match their content id, or a manifest is malformed or unsafe."""


class StorageError(TierCacheError, OSError):
    """A tier failed to read or write (the underlying error is the ``__cause__``)."""


class TierFullError(StorageError):
    """A tier has no room for the bytes it was asked to hold (ENOSPC or over its capacity)."""


class TierUnavailableError(StorageError, ConnectionError):
    """A tier cannot be reached: an S3 endpoint that refuses connections or times out."""


class AgentUnavailableError(TierUnavailableError):
    """The node agent (``[agent]``) cannot be reached, refused this process, or was lost.

    ``save()`` never raises it: a process that loses its agent saves in process from then on.
    ``tiercache agent status``/``stop`` exit 1 with it when no agent runs for the cache.
    """


class AccessDeniedError(StorageError, PermissionError):
    """The credentials are refused by the storage (S3 403, EACCES on disk)."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The S3 bucket named in the configuration does not exist."""


class DeadlineExceededError(StorageError, TimeoutError):
    """A write kept failing with retryable errors until its deadline passed."""


class SkippedError(TierCacheError):
    """The policy skipped this version for a durability level, so that level is never reached."""


class StateMismatchError(TierCacheError, ValueError):
    """A tensor given in ``restore(into=...)`` does not match the saved one (dtype or shape)."""


class LastCopyError(TierCacheError):
    """The operation would drop the last durable copy of a chunk or version."""


class GroupSaveError(TierCacheError):
    """A multi-rank version failed: some rank failed (or died) while saving its part.

    Every rank's handle raises this error with the same message; nothing was committed on the
    tier it names.
    """


class GroupBrokenError(GroupSaveError):
    """The process group cannot save or restore any more: a rank died, or the job's store is gone.

    Every later save and restore through the group fails at once with this error, whose message
    says what broke and when; restart the job (or the failed ranks) to go on.
    """


class CacheClosedError(TierCacheError, RuntimeError):
    """The cache was closed; no further calls are accepted."""


def error_parts(e: BaseException) -> tuple[str, str]:
    """An error as it crosses to another process (the agent's socket, a group's exchange): class name, message.

    :func:`rebuild_error` rebuilds it there. Only names and text cross: nothing received is
    ever unpickled.
    """
    return type(e).__name__, str(e)


def rebuild_error(name: str, message: str, *, fallback: type[TierCacheError] = TierCacheError) -> TierCacheError:
    """The error :func:`error_parts` described: the same class of this module where there is one.

    Args:
        name: The error's class name.
        message: Its message.
        fallback: The class of the error returned for any other class, and for a class whose
            constructor needs keyword attributes (its message then starts with ``name: ``).
    """
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, TierCacheError):
        try:
            return cls(message)
        except TypeError:  # an error class with required keyword attributes
            pass
    return fallback(f"{name}: {message}" if name and cls is not fallback else message)


def _rebuild(cls: type[TierCacheError], message: str, attrs: dict[str, str]) -> TierCacheError:
    """Unpickle an error whose constructor takes keyword attributes (errors cross process boundaries)."""
    return cls(message, **attrs)


__all__ = [
    "AccessDeniedError",
    "AgentUnavailableError",
    "AmbiguousRefError",
    "BranchNotFoundError",
    "BucketNotFoundError",
    "CacheClosedError",
    "ConfigError",
    "ConflictError",
    "DeadlineExceededError",
    "GroupBrokenError",
    "GroupSaveError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidNameError",
    "LastCopyError",
    "RefExistsError",
    "SkippedError",
    "StateMismatchError",
    "StorageError",
    "TierCacheError",
    "TierFullError",
    "TierUnavailableError",
    "UnsupportedStateError",
    "VersionNotFoundError",
    "error_parts",
    "rebuild_error",
]
