"""The save engine: staging, hashing, placement, one writer per tier, the RAM read cache.

:class:`~tiercache.pipeline.engine.Engine` runs it; it writes through the storage layer
(:mod:`tiercache.repo`) and never writes a manifest or a ref, or deletes anything, by itself.
"""
