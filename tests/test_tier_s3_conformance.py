"""The tier conformance suite against the real S3-compatible server of ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tier_conformance import TierConformance

from tiercache.config import S3Config
from tiercache.tiers.s3 import S3Tier


class TestS3Conformance(TierConformance):
    @pytest.fixture
    def tier(self, s3_config: S3Config) -> Iterator[S3Tier]:
        t = S3Tier(s3_config)
        yield t
        t.close()
