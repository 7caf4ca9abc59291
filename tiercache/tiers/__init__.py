"""Storage tiers: the RAM arena, a local disk directory and an S3 prefix, behind one contract."""

from tiercache.tiers.base import RefValue, Tier

__all__ = ["RefValue", "Tier"]
