import pytest
from tier_conformance import TierConformance
from tiercache.tiers.s3 import S3Tier

class TestS3Conformance(TierConformance):
    @pytest.fixture
    def tier(self, s3_config):
        t = S3Tier(s3_config)
        yield t
        t.close()
