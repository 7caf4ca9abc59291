"""Built-in policies and the registry that finds a policy by name.

``load_policy(cfg)`` accepts a registered name (``write-through``), a preset shipped in
``policies/<name>.toml``, a ``package.module:Class`` path, or a name registered by another
package under the entry-point group ``tiercache.policies``.
"""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Callable
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tiercache.config import PolicyConfig
from tiercache.errors import ConfigError
from tiercache.policy.base import OnFull, Placement, Policy, PolicyContext, TierPlan, VersionView

_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator registering a policy under ``name``."""

    def deco(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_names() -> list[str]:
    """Names of the registered built-in policies."""
    return sorted(_REGISTRY)


@register("write-through")
class WriteThrough:
    """Every version to every durable tier, raw; keep the newest ``keep`` versions per tier.

    Args:
        keep: Versions kept per tier when a tier is over capacity (branch heads and tags are
            always kept on top of these).
        on_full: What ``save()`` does when the RAM arena is full: ``wait`` (default) for older
            versions to finish writing, or ``skip`` this version.
    """

    def __init__(self, keep: int = 3, on_full: OnFull = "wait") -> None:
        if keep < 1:
            raise ConfigError(f"write-through: keep must be >= 1, got {keep}")
        if on_full not in ("wait", "skip", "evict"):
            raise ConfigError(f"write-through: on_full must be wait, skip or evict, got {on_full!r}")
        self.keep = keep
        self._on_full: OnFull = on_full

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        """Place the version on every configured durable tier, fastest first, uncompressed."""
        durable = [t for t in ctx.tiers.values() if t.durable]
        return Placement(tuple(TierPlan(t.name) for t in durable))

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        """Oldest unpinned versions on ``tier`` beyond the newest ``keep``."""
        on_tier = [v for v in ctx.versions if tier in v.tiers]
        excess = on_tier[: max(0, len(on_tier) - self.keep)]
        return [v.id for v in excess if not v.pinned]

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        """Wait for the engine to free arena space (or skip, if configured)."""
        return self._on_full


def _preset_dirs() -> list[Path]:
    dirs = [Path(__file__).resolve().parents[2] / "policies"]  # a source checkout
    try:
        dirs.append(Path(str(resources.files("tiercache") / "_presets")))  # an installed wheel
    except (ModuleNotFoundError, TypeError):
        pass
    return dirs


def _load_preset(name: str) -> PolicyConfig | None:
    for d in _preset_dirs():
        path = d / f"{name}.toml"
        if path.is_file():
            try:
                with path.open("rb") as fh:
                    data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"policy preset {path} is not valid TOML: {e}") from None
            table = data.get("policy", data)
            try:
                cfg = PolicyConfig.model_validate(table)
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                raise ConfigError(f"policy preset {path}: field '{field}': {err['msg']}") from None
            if cfg.name == name:
                raise ConfigError(f"policy preset {path} names itself ({name!r}): name a built-in policy")
            return cfg
    return None


def _from_entry_points(name: str) -> Callable[..., Policy] | None:
    for ep in metadata.entry_points(group="tiercache.policies"):
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    return None


def _from_path(spec: str) -> Callable[..., Policy]:
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"policy {spec!r} cannot be imported: {e}") from None
    return obj  # type: ignore[no-any-return]


def load_policy(cfg: PolicyConfig, *, _depth: int = 0) -> Policy:
    """Instantiate the policy a config names.

    Raises:
        ConfigError: If the name is unknown, a preset is malformed, or the parameters are not
            accepted by the policy (the message names the policy and the parameter).
    """
    factory: Callable[..., Policy] | None
    params: dict[str, Any] = dict(cfg.params)
    if cfg.name in _REGISTRY:
        factory = _REGISTRY[cfg.name]
    elif ":" in cfg.name:
        factory = _from_path(cfg.name)
    else:
        preset = _load_preset(cfg.name) if _depth == 0 else None
        if preset is not None:
            merged = PolicyConfig(name=preset.name, params={**preset.params, **params})
            return load_policy(merged, _depth=1)
        factory = _from_entry_points(cfg.name)
        if factory is None:
            known = ", ".join(registered_names())
            raise ConfigError(
                f"unknown policy {cfg.name!r}: use one of {known}, a preset in policies/, "
                "or package.module:Class"
            )
    try:
        policy = factory(**params)
    except TypeError as e:
        raise ConfigError(f"policy {cfg.name!r}: bad parameters {sorted(params)}: {e}") from None
    for method in ("place", "evict", "on_full"):
        if not callable(getattr(policy, method, None)):
            raise ConfigError(f"policy {cfg.name!r} has no {method}() method: implement tiercache.Policy")
    return policy
