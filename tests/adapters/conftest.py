import pytest
from adapter_helpers import Tiny

import flame_core as flame


@pytest.fixture
def tiny(device):
    flame.manual_seed(0)
    return Tiny(device=device)
