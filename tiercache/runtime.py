"""The typed runtime-status model: what a cache and its node agent are doing now (see ``docs/design.md``).

Three views of runtime state share these models:

- :class:`Status`: what the saving process publishes for viewers in other processes
  (``stats/status.json``, ``TierCache.status()``), made by :class:`tiercache.status.StatusRecorder`.
  Every field has a default, so a document of an older writer that lacks a newer field still
  loads; fields a newer writer adds are ignored.
- :class:`AgentStats`: what a node agent holds and does (the ``stats`` request, ``tiercache agent
  status``, its Prometheus metrics).
- :class:`CacheStats`: ``TierCache.stats()``: the meter, each tier's usage and room, lost
  versions, and (with a node agent) the agent's :class:`AgentStats`, merged by
  :meth:`CacheStats.with_agent`.

The public methods return plain dicts (``to_json()``): the models fix their shape, and readers
(the UI, the CLI, the metrics) parse them back with ``model_validate``. The meter's snapshot
(:meth:`tiercache.pipeline.meter.ThroughputMeter.snapshot`) and the advisor's plan stay the
dicts their own modules define.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

#: How many of each kind a status keeps (the recorder trims to these; a document with more, from a
#: shared directory, is not one: it reads as no status).
RECENT_VERSIONS = 64
RECENT_ERRORS = 20
RECENT_SAMPLES = 32
LAG_HISTORY = 300


class _Model(BaseModel):
    # Ignore what a newer writer adds: a viewer's aid must not fail on a field it does not know.
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict the public methods return and ``status.json`` stores."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# The status a saving process publishes (stats/status.json)


class Measure(_Model):
    """One measurement in seconds: an EWMA of every sample, the newest, and the newest few ``[t, seconds]``."""

    ewma: float | None = None
    last: float | None = None
    count: int = 0
    recent: list[list[float]] = Field(default_factory=list, max_length=RECENT_SAMPLES)


class Staged(_Model):
    """The newest ``save()`` call."""

    version: str
    branch: str
    step: int
    at: float


class StepAt(_Model):
    """The newest step seen on a branch, and when."""

    step: int
    at: float


class Reached(_Model):
    """The newest version of a branch that reached a level."""

    version: str
    step: int
    created_at: float
    reached_at: float


class Lag(_Model):
    """What a failure now would lose at a level: training steps and seconds behind."""

    steps: int
    seconds: float


class LagSample(_Model):
    """One sample of a branch's lag per level."""

    t: float
    branch: str
    step: int | None = None
    levels: dict[str, Lag | None] = Field(default_factory=dict)


class LevelState(_Model):
    """Where a version is at one level: ``pending``, ``held``, ``skipped`` or ``failed`` (``reason`` says why)."""

    state: Literal["pending", "held", "skipped", "failed"]
    at: float | None = None
    reason: str = ""


class VersionStatus(_Model):
    """A recent version of the saving process, level by level."""

    branch: str
    step: int
    created_at: float
    wait_s: float = 0.0
    levels: dict[str, LevelState] = Field(default_factory=dict)


class LevelError(_Model):
    """A level a version failed to reach; ``error`` names the error's public class."""

    t: float
    version: str
    branch: str
    step: int
    level: str
    error: str
    message: str


class Status(_Model):
    """The status object (``schema_version`` 1); see :mod:`tiercache.status` for what each field means."""

    schema_version: Literal[1] = 1
    pid: int | None = None
    writer: Literal["trainer", "agent"] = "trainer"
    started_at: float | None = None
    updated_at: float | None = None
    closed: bool = False
    levels: list[str] = Field(default_factory=list)
    staged: Staged | None = None
    training: dict[str, StepAt] = Field(default_factory=dict)
    newest: dict[str, dict[str, Reached]] = Field(default_factory=dict)
    lag: dict[str, dict[str, Lag | None]] = Field(default_factory=dict)
    lag_history: list[LagSample] = Field(default_factory=list, max_length=LAG_HISTORY)
    save_wait: Measure = Field(default_factory=Measure)
    time_to: dict[str, Measure] = Field(default_factory=dict)
    restore: Measure = Field(default_factory=Measure)
    restart: Measure = Field(default_factory=Measure)
    queues: dict[str, int] = Field(default_factory=dict)
    versions: dict[str, VersionStatus] = Field(default_factory=dict, max_length=RECENT_VERSIONS)
    errors: list[LevelError] = Field(default_factory=list, max_length=RECENT_ERRORS)
    #: ``ThroughputMeter.snapshot()`` of the writer, or ``None`` in a document without one.
    meter: dict[str, Any] | None = None
    #: The advisor's ``Plan.to_json()``, or ``None``.
    advice: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------
# A node agent's figures (the `stats` request)


class ArenaStats(_Model):
    """The agent's shared RAM arena (``path`` ``None`` until the first save makes it)."""

    path: str | None = None
    capacity: int | None = None
    used_bytes: int = 0


class ClientStats(_Model):
    """One connected process: what it holds of the agent, and how many versions it published."""

    pid: int
    reservations: int
    pins: int
    saves: int


class PartCounts(_Model):
    """Ranks' parts of group versions: being written, and kept after their trainer died."""

    in_flight: int = 0
    orphaned: int = 0


class OrphanedVersion(_Model):
    """A group version some of whose ranks' parts the agent keeps for a restarted group."""

    v: str
    branch: str
    step: int
    world: int
    ranks: list[int]


class PeerBytes(_Model):
    """Bytes of peer copies sent to and received from other nodes' agents."""

    sent: int = 0
    received: int = 0


class AgentStats(_Model):
    """What a node agent holds and does (``tiercache agent status``, the metrics, ``stats()["agent"]``).

    ``levels`` counts ``"level:outcome"`` (``ok``, ``skipped``, ``failed``); ``lag`` is its status
    recorder's; ``meter`` what it observed writing and reading (``None`` inside
    :class:`CacheStats`, whose own ``meter`` is then the agent's).
    """

    pid: int
    started_at: float
    socket: str
    cache: str
    metrics: str | None = None
    arena: ArenaStats = Field(default_factory=ArenaStats)
    clients: list[ClientStats] = Field(default_factory=list)
    in_flight: int = 0
    tracked: int = 0
    parts: PartCounts = Field(default_factory=PartCounts)
    parts_released: int = 0
    #: Kept parts let go because their group committed their version after all (nothing lost).
    parts_settled: int = 0
    orphans: list[OrphanedVersion] = Field(default_factory=list)
    orphans_limit: int = 0
    queues: dict[str, int] = Field(default_factory=dict)
    levels: dict[str, int] = Field(default_factory=dict)
    restores: dict[str, int] = Field(default_factory=dict)
    restore_bytes: dict[str, int] = Field(default_factory=dict)
    served_bytes: dict[str, int] = Field(default_factory=dict)
    peer_bytes: PeerBytes = Field(default_factory=PeerBytes)
    request_errors: dict[str, int] = Field(default_factory=dict)
    lag: dict[str, dict[str, Lag | None]] = Field(default_factory=dict)
    lost_versions: int = 0
    meter: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------
# TierCache.stats()

#: The keys of a durable tier's room (:meth:`tiercache.repo.room.Room.to_json` and ``state``).
_ROOM_KEYS = ("full", "free_bytes", "reclaimable_bytes", "next_version_bytes", "state")


class TierRoom(_Model):
    """A durable tier's room for the next version; ``state`` is ``available``, ``full`` or ``unavailable``."""

    full: bool | None = None
    free_bytes: int | None = None
    reclaimable_bytes: int | None = None
    next_version_bytes: int | None = None
    state: Literal["available", "full", "unavailable"] = "unavailable"


class TierStats(_Model):
    """One tier's capacity and usage; a durable tier's :class:`TierRoom` is flattened into its entry."""

    capacity: int | None = None
    used_bytes: int | None = None
    available: bool = True
    unavailable: str | None = None
    room: TierRoom | None = None

    @model_validator(mode="before")
    @classmethod
    def _nest_room(cls, data: Any) -> Any:
        if isinstance(data, dict) and "room" not in data and "state" in data:
            data = {**data, "room": {k: data[k] for k in _ROOM_KEYS if k in data}}
        return data

    @model_serializer(mode="wrap")
    def _flatten_room(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        room = out.pop("room", None)
        if room is not None:
            out.update(room)
        return out


class ErrorStats(_Model):
    """Versions that reached no durable tier (the count, and the newest few lines)."""

    lost_versions: int = 0
    recent: list[str] = Field(default_factory=list)


class CacheStats(_Model):
    """``TierCache.stats()``: throughput, each tier's usage and room, lost versions, the node agent's figures."""

    meter: dict[str, Any] = Field(default_factory=dict)
    tiers: dict[str, TierStats] = Field(default_factory=dict)
    errors: ErrorStats = Field(default_factory=ErrorStats)
    agent: AgentStats | None = None

    def with_agent(self, agent: AgentStats) -> CacheStats:
        """These figures of a trainer's own cache, with its node agent's.

        The agent does the writes: its meter is the cache's, and the versions it lost count
        beside the ones this process lost.
        """
        errors = ErrorStats(lost_versions=self.errors.lost_versions + agent.lost_versions,
                            recent=self.errors.recent)
        return self.model_copy(update={"meter": agent.meter or {}, "errors": errors,
                                       "agent": agent.model_copy(update={"meter": None})})

    def to_json(self) -> dict[str, Any]:
        """The dict ``TierCache.stats()`` returns: ``"agent"`` (without its meter) only with a node agent."""
        exclude: Any = {"agent": {"meter"}} if self.agent is not None else {"agent"}
        return self.model_dump(mode="json", exclude=exclude)


__all__ = ["AgentStats", "ArenaStats", "CacheStats", "ClientStats", "ErrorStats", "Lag", "LagSample", "LevelError",
           "LevelState", "Measure", "OrphanedVersion", "PartCounts", "PeerBytes", "Reached", "Staged", "Status",
           "StepAt", "TierRoom", "TierStats", "VersionStatus"]
