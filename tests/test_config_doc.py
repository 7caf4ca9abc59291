"""docs/config.md's "Every field, with its default" against the config model: every field, each default true."""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tiercache.config import CacheConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
#: A comment that says a documented value is an example: the field has no default, or none is set.
_EXAMPLE = ("unset", "optional", "omit", "no default", "required", "default:")


def _documented() -> dict[tuple[str, ...], tuple[Any, str]]:
    """Each field of the doc's TOML block: its value and its comment (continuation lines included)."""
    text = DOC.read_text().split("## Every field, with its default", 1)[1]
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    fields: dict[tuple[str, ...], tuple[Any, str]] = {}
    table: tuple[str, ...] = ()
    last: tuple[str, ...] | None = None
    for line in block.splitlines():
        code, _, comment = line.partition(" # ")
        if line.lstrip().startswith("#") and last is not None:  # a comment continuing the field above
            fields[last] = (fields[last][0], f"{fields[last][1]} {line.strip().lstrip('#').strip()}")
            continue
        if code.startswith("["):
            table, last = (code.strip().strip("[]").strip(),), None
            continue
        if not code.strip():
            continue
        ((key, value),) = tomllib.loads(code).items()
        last = (*table, key)
        fields[last] = (value, comment.strip())
    return fields


def _model_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for name, info in model.model_fields.items():
        sub = next((a for a in (typing.get_args(info.annotation) or (info.annotation,))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None and not prefix:
            out.update(_model_fields(sub, (name,)))
        else:
            out[(*prefix, name)] = info
    return out


def _validated(path: tuple[str, ...], value: Any) -> Any:
    """``value`` as the model stores field ``path`` (sizes and durations parsed), in a config that sets it."""
    data: dict[str, Any] = {"disk": {"path": "x"}}
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    if path[0] == "s3":
        node.setdefault("url", "s3://bucket/prefix")
    cfg: Any = CacheConfig.model_validate(data)
    for part in path:
        cfg = getattr(cfg, part)
    return cfg


def test_every_field_of_the_config_model_is_documented_and_nothing_else() -> None:
    documented, model = _documented(), _model_fields(CacheConfig)
    assert sorted(set(model) - set(documented)) == []
    assert sorted(set(documented) - set(model)) == []


def test_every_documented_value_is_the_default_or_says_it_is_an_example() -> None:
    wrong = []
    for path, (value, comment) in _documented().items():
        info = _model_fields(CacheConfig)[path]
        if info.is_required() or info.default is None or info.default is PydanticUndefined:
            if not info.is_required() and not any(w in comment for w in _EXAMPLE):
                wrong.append(f"{'.'.join(path)}: an example value, but the comment does not say it is unset by default")
            continue
        default = info.default
        stated = comment.partition("default ")[2].split()[0].strip('";,:') if "default " in comment else None
        if stated is not None:  # `4GiB  # default "auto": ...`: the comment states the default
            if _validated(path, stated) != _validated(path, default):
                wrong.append(f"{'.'.join(path)}: the comment says default {stated}, the code {default!r}")
        elif _validated(path, value) != _validated(path, default):
            wrong.append(f"{'.'.join(path)}: documented {value!r}, the default is {default!r}")
    assert wrong == []
