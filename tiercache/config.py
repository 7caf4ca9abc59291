"""Cache configuration: pydantic models, TOML files and ``TIERCACHE_*`` environment variables.

Every default knob of tiercache lives here and nowhere else. A config is given in code (a dict or a
:class:`CacheConfig`), as a path to a TOML file with the same tables, or by ``TIERCACHE_CONFIG``
naming that file. Environment variables ``TIERCACHE_<TABLE>__<FIELD>`` (for example
``TIERCACHE_S3__ENDPOINT_URL``) or, for top-level fields, ``TIERCACHE_<FIELD>`` add to it. One
precedence for every source, the one pydantic-settings applies: what code gives wins over the
environment, and the environment wins over a file and over the defaults (see :func:`load_config`).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic import ByteSize as PydanticByteSize

from tiercache.errors import ConfigError

SCHEMA_VERSION = 1
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
#: The smallest ``chunk_bytes``: it bounds the number of chunks of a state.
MIN_CHUNK_BYTES = 64 * KIB
#: The durable tiers a cache may have, fastest first (each is a table of the config).
DURABLE_TIERS: tuple[str, ...] = ("disk", "s3")

log = logging.getLogger("tiercache.config")

_SIZES = TypeAdapter(PydanticByteSize)
_IEC_SHORT = re.compile(r"(.*\d\s*[KMGTPE]i)\s*", re.IGNORECASE)  # "8Gi", as Kubernetes writes it


def parse_size(value: object) -> int:
    """Parse a byte size: an int, or a string such as ``"4GiB"``, ``"100 GB"``, ``"64MiB"``, ``"8Gi"``.

    Parsed by pydantic's ``ByteSize`` (``KB`` is 1000 bytes, ``KiB`` 1024), which also takes the
    unit's first letter alone (``"4G"`` is 4 GB); ``Ki``/``Mi``/``Gi``... are read as ``KiB``...

    Raises:
        ValueError: If the value is negative or not a size.
    """
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 4GiB, not a bool")
    if isinstance(value, int) and value < 0:
        raise ValueError("a byte size cannot be negative")
    if isinstance(value, str) and (short := _IEC_SHORT.fullmatch(value)):
        value = short.group(1) + "B"
    if isinstance(value, int | str):
        try:
            return int(_SIZES.validate_python(value))
        except ValidationError:
            pass
    raise ValueError(f"expected a byte size such as 4GiB or 500MB, got {value!r}")


ByteSize = Annotated[int, BeforeValidator(parse_size)]


def _size_or_auto(value: object) -> int | str:
    return "auto" if value == "auto" else parse_size(value)


AutoByteSize = Annotated[int | Literal["auto"], BeforeValidator(_size_or_auto)]

_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*")
_DURATION_UNITS = {
    "": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}


def parse_duration(value: object) -> float:
    """Parse a duration in seconds: a number, or a string such as ``"90s"``, ``"5min"``, ``"3h"``, ``"2d"``.

    Raises:
        ValueError: If the value is negative, not finite or not a duration.
    """
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 3h, not a bool")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.fullmatch(value)) and m.group(2).lower() in _DURATION_UNITS:
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"expected a duration such as 90s, 5min, 3h or 2d, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be finite and not negative, got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: A node or failure-domain label (the same alphabet as branch names).
_LABEL_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


#: An automatically sized RAM arena (``ram.capacity = "auto"``, or no ``[ram]`` table) grows with the
#: largest version saved, to at most this fraction of the node's memory (its cgroup limit, if lower).
AUTO_ARENA_FRACTION = 0.5


class RamConfig(_Model):
    """The RAM arena: staging area for every save, and the fastest tier for restores.

    Attributes:
        capacity: Arena size; allocated on first use, pre-faulted, never exceeded. ``"auto"``
            (the default) sizes it to hold two versions of the largest state saved so far: it
            grows when a larger version comes (once the versions in flight have settled), to at
            most half of the node's memory (:data:`AUTO_ARENA_FRACTION`).
        serve_reads: Keep durable versions in the arena after they are written, so restores
            of recent versions run at memcpy speed.
        pin_memory: Pin the arena (page-locked) when CUDA is available, for async GPU copies.
        copy_threads: Threads that copy a CPU state into the arena during ``save()``, the
            calling thread included; ``"auto"`` uses the cores this process may run on (at most
            8). Training is blocked in ``save()`` meanwhile, so those cores are otherwise idle.
    """

    capacity: AutoByteSize = "auto"
    serve_reads: bool = True
    pin_memory: bool = True
    copy_threads: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"

    def resolved_copy_threads(self) -> int:
        """``copy_threads`` as a number: ``"auto"`` is the usable cores, at most 8."""
        if self.copy_threads != "auto":
            return self.copy_threads
        return min(8, usable_cores())


class DiskConfig(_Model):
    """A local directory (NVMe) tier.

    Attributes:
        path: Root directory; created 0700 by the first write (reading makes nothing).
        capacity: Byte budget, or ``None`` for the free space of the filesystem.
        o_direct: Write and read chunks with O_DIRECT (falls back to buffered I/O where the
            filesystem refuses it).
        io_threads: Threads writing chunks to this tier (restores use the top-level ``io_threads``).
        shared: The directory is on a filesystem every node of a multi-rank job sees (NFS,
            Lustre...): the ranks then split its writes as they do S3's, and rank 0 commits. By
            default a disk is node-local: each node holds what its own ranks need.
    """

    path: Path
    capacity: ByteSize | None = None
    o_direct: bool = True
    io_threads: int = Field(default=4, ge=1, le=64)
    shared: bool = False


class S3Config(_Model):
    """An S3-compatible object store tier.

    Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
    ``AWS_PROFILE``, instance roles); they are never part of this config or of any output.

    Attributes:
        url: ``s3://bucket/prefix`` under which this cache keeps its objects.
        endpoint_url: Endpoint of a non-AWS store (MinIO, SeaweedFS), e.g. ``http://127.0.0.1:9000``.
        region: AWS region name.
        verify_tls: Verify the endpoint's TLS certificate (turn off only for self-signed tests).
        part_size: Multipart part size for large objects.
        max_concurrency: Parallel part uploads/downloads; in a multi-rank job, per node (the
            ranks of a node share it).
        max_attempts: Attempts per request for retryable errors (throttling, 5xx, resets).
        throttle_retries: Further tries of a write the store keeps throttling (``503 SlowDown``)
            after ``max_attempts``, each after halving the writes in flight and a longer wait:
            a throttled store slows saves down instead of failing them (``deadline_s`` still
            bounds a version).
        connect_timeout: Seconds to wait for a connection.
        read_timeout: Seconds a request may wait for the server's next bytes before it counts as
            failed (and is retried); an endpoint that accepts connections and never answers
            fails each attempt after this long.
        probe_timeout: Seconds the open check and the health probes (one HEAD of the bucket,
            never retried) wait for a connection and for the answer: with S3 down or hanging,
            ``tiercache.open()`` and read-only commands go on without it after at most this
            long, serving what the other tiers hold.
        deadline_s: Seconds a version's chunk uploads (retries included) may take before that
            write fails with ``DeadlineExceededError`` and S3 counts as down (a version durable on
            disk then waits for S3's catch-up, as in any outage); ``None`` for no limit.
        addressing_style: ``path`` (MinIO, SeaweedFS) or ``virtual``; ``auto`` picks ``path``
            when an endpoint_url is set.
        allow_unsafe_refs: Commit refs even on a store that ignores conditional writes (as
            reported by ``tiercache doctor``); safe only while a single writer uses the prefix.
    """

    url: str
    endpoint_url: str | None = None
    region: str | None = None
    verify_tls: bool = True
    part_size: ByteSize = 16 * MIB
    max_concurrency: int = Field(default=8, ge=1, le=64)
    max_attempts: int = Field(default=5, ge=1, le=20)
    throttle_retries: int = Field(default=8, ge=0, le=100)
    connect_timeout: float = Field(default=3.0, gt=0)
    read_timeout: float = Field(default=20.0, gt=0)
    probe_timeout: float = Field(default=3.0, gt=0)
    deadline_s: float | None = Field(default=900.0, gt=0)
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    allow_unsafe_refs: bool = False

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith("s3://") or not v[5:].split("/", 1)[0]:
            raise ValueError("expected s3://bucket/prefix")
        return v.rstrip("/")

    @property
    def bucket(self) -> str:
        """The bucket part of ``url``."""
        return self.url[5:].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """The key prefix part of ``url`` (no leading or trailing slash; may be empty)."""
        parts = self.url[5:].split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""


class PeersConfig(_Model):
    """Peer copies of multi-rank versions (see :mod:`tiercache.peers`).

    Attributes:
        copies: How many other nodes receive a copy of each node's part of a version on their
            node-local disk, in the background after ``local``; the level ``replicated`` says
            when every node's part is on ``copies + 1`` nodes. 0 turns peer copies off.
        batch_bytes: Most bytes one rank receives from its peers at once (peer copies and
            restores over the group): the memory a transfer holds.
    """

    copies: int = Field(default=0, ge=0, le=16)
    batch_bytes: ByteSize = Field(default=256 * MIB, ge=64 * KIB)


class EngineConfig(_Model):
    """How the save pipeline reports failures and watches its tiers.

    Attributes:
        on_error: What ``save()`` does about an earlier version that reached no durable tier:
            ``"warn"`` (default) logs it once at ERROR, counts it in ``stats()`` and raises it
            from ``flush()``/``close()``, so a failed checkpoint never stops training;
            ``"raise"`` raises it from the next ``save()`` after the new version is staged
            (the new version's handle is on the exception as ``handle``). A version that
            reached one durable tier but not another is not an error: its handle says which
            level failed and why, and ``tiercache ls`` shows it.
        probe_interval_s: Seconds between probes of a tier that is down (an S3 outage, a full
            or failing disk); when one answers, the newest version of each branch and every
            tag are copied there.
    """

    on_error: Literal["warn", "raise"] = "warn"
    probe_interval_s: float = Field(default=5.0, gt=0)


class PolicyConfig(_Model):
    """Which policy decides placement, retention and compression, and its parameters.

    Attributes:
        name: A registered policy name (``write-through``...), a preset in ``policies/``, or
            ``package.module:Class``.
        params: Keyword arguments for the policy's constructor.
    """

    name: str = "throughput-adaptive"
    params: dict[str, Any] = Field(default_factory=dict)


class UiConfig(_Model):
    """``tiercache ui``, and the status a saving process publishes for it.

    Attributes:
        host: Address the UI listens on; anything but loopback requires a token on every request.
        port: Port the UI listens on.
        refresh: Seconds between two refreshes of the page (and two readings of the cache by the server).
        status_interval: A process that saves writes ``stats/status.json`` (its staged versions,
            queues, measured save costs) at most once per this many seconds, and when it closes.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    refresh: float = Field(default=2.0, gt=0)
    status_interval: float = Field(default=1.0, gt=0)


class AdvisorConfig(_Model):
    """Inputs of the checkpoint-interval advisor (``cache.advisor()``, ``tiercache plan``, the UI).

    Attributes:
        mttf: Mean time to failure of the whole job (a duration such as ``"3h"``), or ``None``
            to ask for it (``--mttf``, ``advisor(mttf=...)``).
        restart: Seconds a failed job takes to be running again before its restore starts
            (scheduling, start-up); not measurable by the cache, so it is an assumption.
        min_interval: Shortest interval the advisor may advise, in seconds.
        max_interval: Longest interval the advisor may advise, in seconds (``None``: no bound).
    """

    mttf: Duration | None = None
    restart: Duration = 0.0
    min_interval: Duration = 0.0
    max_interval: Duration | None = None


class AgentConfig(_Model):
    """The node agent (:mod:`tiercache.agent`): one process per node owns the RAM tier and does the background work.

    With this table, ``save()`` copies into node memory the agent owns and hands the version to
    it; the RAM tier then outlives a trainer crash. Without it, everything runs in the trainer.

    Attributes:
        socket: The Unix socket the agent listens on; ``None``: ``agent-<key>.sock`` in
            ``$XDG_RUNTIME_DIR/tiercache`` (else ``/tmp/tiercache-<uid>``), ``key`` naming this
            cache (disk path, S3 url, node): one agent per cache and node.
        start: ``"auto"``: the first process on the node that saves and finds no agent starts
            one, detached from its own process tree; ``"never"``: the operator runs
            ``tiercache agent`` (systemd, a Kubernetes sidecar, ``srun --ntasks-per-node=1``), and
            a process that finds none saves in process.
        shm_dir: Where the agent keeps the arena: a ``0600`` file per cache, node and boot
            (``/dev/shm``; a ``tmpfs`` or ``emptyDir: {medium: Memory}`` mount).
        metrics: ``HOST:PORT`` where the agent serves Prometheus metrics (``None``: not served).
        idle_exit: Seconds an agent with no client and nothing left to write waits before it
            exits (its RAM copies go; everything is durable by then). 0: it never exits on its own.
        connect_timeout: Seconds a process waits for an agent to answer, or to start.
        request_timeout: Seconds without a word from the agent after which a request counts as
            lost: the process saves in process from then on (an agent waiting for room in its
            arena says so every second).
        peer_host: The address this node's agent takes peer copies (``[peers]``) from other
            nodes' agents on, a free port of it; ``None``: the address this node reaches the
            job's store from (torchrun's rendezvous, ``MASTER_ADDR``).
    """

    socket: Path | None = None
    start: Literal["auto", "never"] = "auto"
    shm_dir: Path = Path("/dev/shm")
    metrics: str | None = None
    idle_exit: Duration = 600.0
    connect_timeout: float = Field(default=20.0, gt=0)
    request_timeout: float = Field(default=30.0, gt=0)
    peer_host: str | None = None

    @field_validator("metrics")
    @classmethod
    def _check_metrics(cls, v: str | None) -> str | None:
        if v is not None:
            host, sep, port = v.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9464")
        return v


def agent_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where agents keep default sockets and logs: ``$XDG_RUNTIME_DIR/tiercache``, else ``/tmp/tiercache-<uid>``."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "tiercache"
    return Path(tempfile.gettempdir()) / f"tiercache-{os.getuid()}"


class CacheConfig(_Model):
    """The whole configuration of one cache.

    Attributes:
        schema_version: Version of this config schema.
        ram: The RAM arena, or ``None`` for a minimal staging arena that serves no reads.
        disk: The local disk tier, if any.
        s3: The S3 tier, if any.
        policy: The policy.
        chunk_bytes: Largest chunk; big tensors are split into chunks of this size.
        pack_below: Tensors smaller than this are packed together into shared chunks.
        hash: Content hash that names chunks.
        allow_pickle: Store leaves that are not tensors or plain values with pickle, and
            unpickle them on restore (only for versions written with this opt-in).
        io_threads: Threads writing (and compressing) chunks for each durable tier (the disk tier
            uses ``disk.io_threads``); also the chunks a restore reads at once.
        background_nice: How much lower than the training thread the engine's background threads
            run (Linux nice increment; 0 keeps them at the same priority).
        gc_grace: Seconds during which ``gc`` leaves a new, unreferenced manifest or chunk alone,
            so a save in flight in another process (chunks written, ref not yet) is never
            collected; keep it above the longest save.
        reflog_keep: Seconds for which a version a branch move left behind (a rollback, a
            resume from an older step) stays reachable through the reflog, safe from ``gc``.
        engine: The save pipeline's error reporting and tier probes.
        ui: ``tiercache ui`` and the status a saving process publishes.
        advisor: The checkpoint-interval advisor's inputs and bounds.
        peers: Peer copies of multi-rank versions.
        node: The name of the node this process runs on, for multi-rank saves (``TIERCACHE_NODE``);
            ``None``: torchrun's ``GROUP_RANK``, else the host name (see :func:`launcher_node`).
        failure_domain: What this node fails together with (a rack, a switch:
            ``TIERCACHE_FAILURE_DOMAIN``); peer copies of a node go to nodes of other domains.
        agent: The node agent; ``None`` (no ``[agent]`` table): the RAM tier and the background
            work stay in the process that saves.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    ram: RamConfig | None = None
    disk: DiskConfig | None = None
    s3: S3Config | None = None
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    chunk_bytes: ByteSize = Field(default=64 * MIB)
    pack_below: ByteSize = Field(default=1 * MIB)
    hash: Literal["xxh3-128", "blake2b"] = "xxh3-128"
    allow_pickle: bool = False
    io_threads: int = Field(default=4, ge=1, le=64)
    background_nice: int = Field(default=10, ge=0, le=19)
    gc_grace: float = Field(default=3600.0, ge=0)
    reflog_keep: float = Field(default=7 * 86400.0, ge=0)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    ui: UiConfig = Field(default_factory=UiConfig)
    advisor: AdvisorConfig = Field(default_factory=AdvisorConfig)
    peers: PeersConfig = Field(default_factory=PeersConfig)
    node: str | None = None
    failure_domain: str | None = None
    agent: AgentConfig | None = None

    @field_validator("node", "failure_domain")
    @classmethod
    def _check_label(cls, v: str | None) -> str | None:
        if v is not None and _LABEL_RE.fullmatch(v) is None:
            raise ValueError("use 1-128 characters from A-Z a-z 0-9 . _ - (not starting with '.')")
        return v

    @field_validator("chunk_bytes")
    @classmethod
    def _check_chunk(cls, v: int) -> int:
        if v < MIN_CHUNK_BYTES or v % 4096:
            raise ValueError("chunk_bytes must be a multiple of 4096 and at least 64KiB")
        return v

    def tier_names(self) -> list[str]:
        """Names of the configured durable tiers, fastest first."""
        return [n for n in DURABLE_TIERS if getattr(self, n) is not None]


#: TIERCACHE_* variables that are not config fields: the config file, the CLI's log level and the
#: failpoints (read by :mod:`tiercache.failpoints`). Any other TIERCACHE_* variable names a field.
_NOT_FIELDS = frozenset({"TIERCACHE_CONFIG", "TIERCACHE_LOG", "TIERCACHE_FAILPOINTS"})
#: The variables that can configure a tier on their own, named when no tier is configured.
_TIER_VARIABLES = "TIERCACHE_DISK__PATH, TIERCACHE_S3__URL or TIERCACHE_RAM__CAPACITY"
_PREFIX = "TIERCACHE_"
#: The tables a variable can add to a config given in code (a tier, above all), which deserves a WARNING.
_TABLES = frozenset({"ram", "disk", "s3", "agent", "peers"})


def _env_overrides(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The config tree the ``TIERCACHE_*`` variables describe, and which variable set each field.

    Read by pydantic-settings' environment source over ``env`` (not the process's environment),
    imported only when such a variable is set: it costs a command's start-up ~50 ms otherwise.
    A variable that names no field is kept in the tree as it is, so validation rejects it and
    the error names it.
    """
    variables = {k: v for k, v in env.items() if k.startswith(_PREFIX) and k not in _NOT_FIELDS}
    if not variables:
        return {}, {}
    from pydantic_settings import EnvSettingsSource, SettingsError

    class EnvOverlay(EnvSettingsSource):
        def _load_env_vars(self) -> Mapping[str, str | None]:
            return {k.lower(): v for k, v in variables.items()}

    source = EnvOverlay(CacheConfig, case_sensitive=False, env_prefix=_PREFIX, env_nested_delimiter="__")
    names = {tuple(k[len(_PREFIX):].lower().split("__")): k for k in variables}
    try:
        out = dict(source())
    except SettingsError as e:
        field = str(e).split('"')[1] if '"' in str(e) else ""
        which = ", ".join(sorted(v for p, v in names.items() if p[0] == field)) or "TIERCACHE_*"
        raise ConfigError(f"invalid config from environment variable {which}: not valid JSON for a table "
                          f"({e}); set its fields one by one as TIERCACHE_<TABLE>__<FIELD>") from None
    for path, k in names.items():
        if path[0] not in CacheConfig.model_fields:
            out[path[0]] = env[k]
    return out, names


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def _blame(loc: tuple[str | int, ...], source: Mapping[str, Any], variables: Mapping[tuple[str, ...], str]) -> str:
    """The environment variable(s) behind the invalid field at ``loc``, or ``""`` if it came from the source.

    A variable that set the field (or a table above it) is named; so are the variables that made
    a table the source does not have (``TIERCACHE_S3__MAX_ATTEMPTS`` alone makes an ``s3`` table
    without a url).
    """
    path = tuple(str(p) for p in loc)
    for n in range(len(path), 0, -1):
        if path[:n] in variables:
            return variables[path[:n]]
    if path and path[0] not in source:
        return ", ".join(sorted(v for p, v in variables.items() if p[0] == path[0]))
    return ""


def _main_error(err: ValidationError) -> Any:
    """The error to report first: an unknown field (a typo, whose fallout is the other errors), else the first."""
    errors = err.errors()
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def _fields_at(path: tuple[str | int, ...]) -> list[str]:
    """The fields of the table at ``path`` of the config (empty where no model is known)."""
    model: type[BaseModel] | None = CacheConfig
    for part in path:
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _model_in(tp: Any) -> type[BaseModel] | None:
    """The model class in a field's type (``DiskConfig | None`` -> ``DiskConfig``), if any."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return next((m for m in map(_model_in, get_args(tp)) if m is not None), None)


def _unknown_field(loc: tuple[str | int, ...], blame: str) -> str:
    """What to say of an unknown field: the closest known one (as a variable, if a variable set it)."""
    known = _fields_at(loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if not close:
        return f"unknown field: the known ones are {', '.join(known)}" if known else "unknown field"
    if blame:
        return f"unknown field: did you mean {_PREFIX}{'__'.join(map(str, (*loc[:-1], close[0]))).upper()}?"
    return f"unknown field: did you mean '{close[0]}'?"


def _format_error(err: ValidationError, source: str, blame: str) -> str:
    first = _main_error(err)
    field = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = _unknown_field(first["loc"], blame) if first["type"] == "extra_forbidden" else first["msg"]
    extra = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    where = f"from environment variable {blame}" if blame else source
    return f"invalid config {where}: field '{field}': {msg}{extra}"


def load_config(
    source: CacheConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> CacheConfig:
    """Build a :class:`CacheConfig` from code, a TOML file, or ``TIERCACHE_CONFIG``, with ``TIERCACHE_*`` variables.

    One precedence, the one pydantic-settings users expect: settings given in code (a dict, or the
    fields a :class:`CacheConfig` was built with) win over the environment; the environment wins
    over a file and over the defaults. A variable that would change a setting given in code is
    ignored with a WARNING naming both; a variable that adds a tier (or any table) to a config given
    in code is taken, with a WARNING; one that fills a field code left unset is taken (INFO).

    Args:
        source: A config object, a mapping with the config's tables, a path to a TOML file, or
            ``None`` to read the file named by ``TIERCACHE_CONFIG`` (or ``./tiercache.toml`` if it
            exists).
        env: Environment to read ``TIERCACHE_*`` variables from (defaults to ``os.environ``).

    Returns:
        The validated, frozen config.

    Raises:
        ConfigError: If the file is missing or unreadable TOML, or a field is invalid (the
            message names the field and the file or ``TIERCACHE_*`` variable it came from), or
            if a config read from a file or the environment configures no tier (the message
            says where it looked).
    """
    env = os.environ if env is None else env
    in_code = isinstance(source, (CacheConfig, Mapping))
    if isinstance(source, CacheConfig):
        if not any(k.startswith(_PREFIX) and k not in _NOT_FIELDS for k in env):
            return source
        source = source.model_dump(exclude_unset=True)  # what the code set, not the defaults
    label = "(dict)"
    looked_up = source is None
    if source is None:
        named = env.get("TIERCACHE_CONFIG")
        if named:
            source = named
        elif Path("tiercache.toml").is_file():
            source = "tiercache.toml"
        else:
            source = {}
            label = ""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        # A file found by search (TIERCACHE_CONFIG, ./tiercache.toml) may be another user's: it is
        # read only if it is ours; a file named explicitly is read, but never names code to run.
        foreign = untrusted_reason(path)
        if looked_up and foreign:
            raise ConfigError(f"config file {path} is not used: {foreign} (chown it, chmod go-w it, "
                              "or pass the config you mean with --config)")
        data = _read_toml(path)
        label = str(source)
        if foreign and ":" in str(_at(data, ("policy", "name")) or ""):
            raise ConfigError(f"config file {path}: field 'policy.name': a package.module:Class policy is imported "
                              f"only from a config you own ({foreign}): pass it with --policy, or own the file")
    else:
        data = dict(source)
    overrides, variables = _env_overrides(env)
    merged = _merge(overrides, data) if in_code else _merge(data, overrides)
    try:
        cfg = CacheConfig.model_validate(merged)
    except ValidationError as e:
        loc = _main_error(e)["loc"]
        blame = "" if in_code and _given(data, loc) else _blame(loc, data, variables)
        raise ConfigError(_format_error(e, label or "(no file)", blame)) from None
    if in_code and variables:
        _say_what_the_environment_did(data, overrides, variables)
    if (looked_up or label != "(dict)") and cfg.ram is None and not cfg.tier_names():
        raise ConfigError(_no_tier_message(label, Path.cwd()))
    return cfg


def untrusted_reason(path: Path) -> str:
    """Why a config file may hold another user's settings (``""`` if it is safe to act on).

    git's ``safe.directory`` rule: a file is ours if we (or root) own it and nobody else may
    write it: not others, nor a group other than our own primary group.
    """
    try:
        st = path.stat()
    except OSError:
        return ""  # reading it says what is wrong
    uid, gid = os.getuid(), os.getgid()
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid}) or root"
    if st.st_mode & 0o002:
        return "anyone may write it"
    if st.st_mode & 0o020 and st.st_gid != gid:
        return f"group {st.st_gid} may write it"
    return ""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found: pass an existing TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None


def _given(data: Mapping[str, Any], path: tuple[str | int, ...]) -> bool:
    """Whether the config given in code sets ``path`` (or a value above it that is not a table)."""
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return True
        if str(part) not in node:
            return False
        node = node[str(part)]
    return True


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree.get(part) if isinstance(tree, Mapping) else None
    return tree


def _say_what_the_environment_did(data: Mapping[str, Any], overrides: Mapping[str, Any],
                                  variables: Mapping[tuple[str, ...], str]) -> None:
    """Log what the ``TIERCACHE_*`` variables did to a config given in code (see :func:`load_config`)."""
    as_env = CacheConfig.model_validate(_merge(data, overrides)).model_dump(mode="json")
    as_code = CacheConfig.model_validate(_merge(overrides, data)).model_dump(mode="json")
    for path, var in sorted(variables.items()):
        if _given(data, path):
            if _at(as_env, path) != _at(as_code, path):
                log.warning("environment variable %s is ignored: the config given in code sets %s "
                            "(code wins over the environment; unset the variable or change the code)",
                            var, ".".join(path))
        elif path[0] not in data and path[0] in _TABLES:
            log.warning("environment variable %s adds [%s] to the config given in code", var, path[0])
        else:
            log.info("environment variable %s sets %s (the config given in code leaves it unset)",
                     var, ".".join(path))


def this_node(config: CacheConfig) -> tuple[str, str]:
    """This process's node name and failure domain (``""`` when none is configured).

    The name is ``config.node`` (``TIERCACHE_NODE``), else the launcher's node (torchrun's
    ``GROUP_RANK``, see :func:`launcher_node`), else the host name.
    """
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip(".")[:128]
    return config.node or launcher_node() or host or "localhost", config.failure_domain or ""


def launcher_node(env: Mapping[str, str] | None = None) -> str | None:
    """The node name a launcher gives this process, or ``None``.

    torchrun (torchelastic) sets ``GROUP_RANK`` (the node's index among the nodes of the job)
    with ``LOCAL_WORLD_SIZE`` for every worker: the node is then ``node<GROUP_RANK>``. This is
    the one place that reads them; ``TIERCACHE_NODE`` (the ``node`` field) takes precedence, and
    without either the ranks fall back to their host names.

    Args:
        env: The environment (defaults to ``os.environ``).
    """
    env = os.environ if env is None else env
    group = env.get("GROUP_RANK", "")
    if group.isdigit() and env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return f"node{int(group)}"
    return None


def _no_tier_message(label: str, cwd: Path) -> str:
    """Say where a config without any tier was looked for, and what to add."""
    if label:
        return (f"no tier configured in config file {label} (nor by {_TIER_VARIABLES}): "
                "add a [disk] path, an [s3] url or a [ram] table")
    return (f"no tier configured: no config file named (TIERCACHE_CONFIG is not set), no tiercache.toml in "
            f"{cwd}, and none of {_TIER_VARIABLES} set: write a tiercache.toml with a [disk] path, "
            "an [s3] url or a [ram] table (or, on the command line, name the directory: tiercache --disk DIR)")
