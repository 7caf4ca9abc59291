"""The agent's Prometheus endpoint (``[agent] metrics = "HOST:PORT"``; needs ``prometheus_client``).

Every figure is read from the agent when scraped (a collector, no counters to keep in step):

==================================================== ============================================
metric                                               what
==================================================== ============================================
``tiercache_agent_info{pid, cache, socket}``          1, with who the agent is
``tiercache_agent_start_time_seconds``                when it started (Unix time)
``tiercache_agent_clients``                           trainer processes connected
``tiercache_agent_arena_bytes{kind}``                 ``capacity`` and ``used`` of node RAM
``tiercache_agent_tier_bytes{tier}``                  bytes of the distinct chunks each tier holds
``tiercache_agent_tier_versions{tier}``               versions each tier holds whole
``tiercache_agent_tier_up{tier}``                     1 if the tier answers, 0 while it is down
``tiercache_agent_versions_total{level, outcome}``    versions (and group parts) that reached a level
                                                     (``ok``), were ``skipped`` there (the policy's
                                                     choice, or the group's on a part) or ``failed``;
                                                     a level with no tier configured has none
``tiercache_agent_versions_in_flight``                versions the agent is still writing
``tiercache_agent_queue_depth{tier}``                 of them, those still to be written to a tier
``tiercache_agent_group_parts{state}``                ranks' parts of group versions: ``in_flight``, and
                                                     ``orphaned`` (their trainers died before the
                                                     group's commit: ``tiercache agent status``
                                                     says until when they are kept)
``tiercache_agent_lag_seconds{branch, level}``        training time a failure now would lose, per level
``tiercache_agent_lag_steps{branch, level}``          the same in steps
``tiercache_agent_lost_versions_total``               versions that reached no durable tier
``tiercache_agent_request_errors_total{type}``        requests answered with an error, by error type
``tiercache_agent_restores_total{source}``            restores trainers reported, by where bytes came from
``tiercache_agent_restore_bytes_total{source}``       their bytes, by source
``tiercache_agent_ram_served_bytes_total``            bytes of node RAM lent to readers
``tiercache_agent_peer_bytes_total{direction}``       bytes of peer copies (``[peers]``) ``sent`` to and
                                                     ``received`` from other nodes' agents
``tiercache_agent_throughput_bytes_per_second{tier,   observed speed per tier and direction
direction}``
==================================================== ============================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tiercache.errors import ConfigError

if TYPE_CHECKING:
    from tiercache.agent.requests import Requests


def _families(agent: Requests) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    st = agent.stats()
    cache, core = agent.cache, agent.core
    yield InfoMetricFamily("tiercache_agent", "The node agent", value={
        "pid": str(st.pid), "cache": st.cache, "socket": st.socket})
    yield GaugeMetricFamily("tiercache_agent_start_time_seconds", "When the agent started", value=st.started_at)
    yield GaugeMetricFamily("tiercache_agent_clients", "Trainer processes connected", value=len(st.clients))
    arena = GaugeMetricFamily("tiercache_agent_arena_bytes", "Node RAM arena", labels=["kind"])
    arena.add_metric(["capacity"], st.arena.capacity or 0)
    arena.add_metric(["used"], st.arena.used_bytes)
    yield arena
    tier_bytes = GaugeMetricFamily("tiercache_agent_tier_bytes", "Bytes of distinct chunks per tier", labels=["tier"])
    tier_versions = GaugeMetricFamily("tiercache_agent_tier_versions", "Versions held whole per tier",
                                      labels=["tier"])
    up = GaugeMetricFamily("tiercache_agent_tier_up", "Whether the tier answers", labels=["tier"])
    held: dict[str, dict[str, int]] = {t: {} for t in cache.tier_names}
    counts = dict.fromkeys(cache.tier_names, 0)
    cat = core.catalog
    for v in cat.all():
        for tier in cat.residency(v):
            if tier in held:
                counts[tier] += 1
                for c in v.chunks:
                    held[tier][c.id] = c.nbytes
    for tier in cache.tier_names:
        tier_bytes.add_metric([tier], sum(held[tier].values()))
        tier_versions.add_metric([tier], counts[tier])
        up.add_metric([tier], 1 if tier == "ram" or core.repo.health.available(tier) else 0)
    yield from (tier_bytes, tier_versions, up)
    levels = CounterMetricFamily("tiercache_agent_versions", "Versions per level and outcome",
                                 labels=["level", "outcome"])
    for key, n in sorted(st.levels.items()):
        level, _, outcome = key.partition(":")
        levels.add_metric([level, outcome], n)
    yield levels
    yield GaugeMetricFamily("tiercache_agent_versions_in_flight", "Versions being written", value=st.in_flight)
    queue = GaugeMetricFamily("tiercache_agent_queue_depth", "Versions still to write, per tier", labels=["tier"])
    for tier in core.repo.durable:
        queue.add_metric([tier], st.queues.get(tier, 0))
    yield queue
    parts = GaugeMetricFamily("tiercache_agent_group_parts", "Ranks' parts of group versions", labels=["state"])
    for state, n in sorted(st.parts.model_dump().items()):
        parts.add_metric([state], n)
    yield parts
    lag_s = GaugeMetricFamily("tiercache_agent_lag_seconds", "Durability lag in seconds", labels=["branch", "level"])
    lag_n = GaugeMetricFamily("tiercache_agent_lag_steps", "Durability lag in steps", labels=["branch", "level"])
    for branch, per_level in sorted(st.lag.items()):
        for level, lag in sorted(per_level.items()):
            if lag is not None:
                lag_s.add_metric([branch, level], lag.seconds)
                lag_n.add_metric([branch, level], lag.steps)
    yield from (lag_s, lag_n)
    yield CounterMetricFamily("tiercache_agent_lost_versions", "Versions that reached no durable tier",
                              value=st.lost_versions)
    errors = CounterMetricFamily("tiercache_agent_request_errors", "Requests answered with an error", labels=["type"])
    for kind, n in sorted(st.request_errors.items()):
        errors.add_metric([kind], n)
    yield errors
    restores = CounterMetricFamily("tiercache_agent_restores", "Restores by source", labels=["source"])
    restore_bytes = CounterMetricFamily("tiercache_agent_restore_bytes", "Restored bytes by source", labels=["source"])
    for source, n in sorted(st.restores.items()):
        restores.add_metric([source], n)
        restore_bytes.add_metric([source], st.restore_bytes.get(source, 0))
    yield from (restores, restore_bytes)
    yield CounterMetricFamily("tiercache_agent_ram_served_bytes", "Bytes of node RAM lent to readers",
                              value=st.served_bytes.get("ram", 0))
    peer = CounterMetricFamily("tiercache_agent_peer_bytes", "Bytes of peer copies, by direction",
                               labels=["direction"])
    for direction, n in sorted(st.peer_bytes.model_dump().items()):
        peer.add_metric([direction], n)
    yield peer
    speed = GaugeMetricFamily("tiercache_agent_throughput_bytes_per_second", "Observed throughput",
                              labels=["tier", "direction"])
    for tier, per_dir in sorted((st.meter or {}).get("tiers", {}).items()):
        for direction, fig in sorted(per_dir.items()):
            if fig.get("bps"):
                speed.add_metric([tier, direction], fig["bps"])
    yield speed


class _Collector:
    def __init__(self, agent: Requests) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Any]:
        yield from _families(self._agent)


def serve_metrics(agent: Requests, address: str) -> tuple[Any, tuple[str, int]]:
    """Serve ``/metrics`` for the agent whose requests ``agent`` answers, at ``HOST:PORT``, on a thread of its own.

    Returns:
        The HTTP server (``shutdown()`` stops it) and the address it listens on (port 0 picks one).

    Raises:
        ConfigError: If ``prometheus_client`` is missing or the address cannot be bound.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise ConfigError(f"[agent] metrics needs prometheus_client ({e}): "
                          "pip install prometheus_client (the agent extra)") from None
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(agent))  # type: ignore[arg-type]
    try:
        httpd, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as e:
        raise ConfigError(f"[agent] metrics: cannot listen on {address}: {e.strerror}") from None
    bound = httpd.server_address
    return httpd, (str(bound[0]), int(bound[1]))
