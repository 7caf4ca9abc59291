"""The storage layer: tiers, catalog, the one commit path, deletion rules, leases, maintenance.

Everything above it (the save engine in :mod:`tiercache.pipeline`, multi-rank saves, the DCP
integration, the :class:`~tiercache.TierCache` facade and the CLI) reads through it and writes,
moves refs and deletes only by calling it. See :mod:`tiercache.repo.repository`.
"""

from tiercache.repo.doctor import DoctorReport, Upload, doctor
from tiercache.repo.gc import GcReport, gc
from tiercache.repo.health import TierHealth
from tiercache.repo.repository import ObjectReader, Repo
from tiercache.repo.room import Room, full_tiers, room
from tiercache.repo.verify import Damage, VerifyReport, verify

__all__ = [
    "Damage",
    "DoctorReport",
    "GcReport",
    "ObjectReader",
    "Repo",
    "Room",
    "TierHealth",
    "Upload",
    "VerifyReport",
    "doctor",
    "full_tiers",
    "gc",
    "room",
    "verify",
]
