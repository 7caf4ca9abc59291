"""The node agent (docs/design.md section 7b): the RAM tier outlives the trainer, which pays only the memcpy.

One agent process per node and cache owns the node's RAM arena (a ``0600`` file in ``/dev/shm``)
and runs the save pipeline for every process of the node that saves to that cache. A trainer's
``save()`` copies its state into regions of the shared arena and hands the version over in one
message; the agent hashes, places, encodes, writes disk and S3, catches tiers up, and tells the
trainer each level reached. A trainer that crashes loses no version it saved: the next process
on the node attaches, sees what node RAM holds and restores from it at memcpy speed.

Two sides, two floors:

* the client side sits low, beside :mod:`tiercache.handle`, and the facade uses it:
  :mod:`~tiercache.agent.naming` (where an agent lives), :mod:`~tiercache.agent.arena` (the shared
  memory), :mod:`~tiercache.agent.protocol` (framed messages, descriptor passing),
  :mod:`~tiercache.agent.client` (connect, map, ask, the RAM tier as a trainer reads it),
  :mod:`~tiercache.agent.node` (what the facade asks the agent: node RAM, gc, stats),
  :mod:`~tiercache.agent.saver` (the :class:`~tiercache.saver.Saver` that copies and publishes),
  :mod:`~tiercache.agent.lifecycle` (start detached, status, stop, environment checks);
* the server side sits above :mod:`tiercache.pipeline` and :mod:`tiercache.repo`:
  :mod:`~tiercache.agent.server` (the agent process: one cache, one engine over the shared arena,
  the socket and its threads), :mod:`~tiercache.agent.requests` (what it does for each request,
  and the events it sends) and :mod:`~tiercache.agent.metrics` (its Prometheus endpoint).

Nothing on the client side imports the server side.
"""
