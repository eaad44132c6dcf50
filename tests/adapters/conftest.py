import pytest

import flame_core as flame
from adapter_helpers import Tiny


@pytest.fixture
def tiny(device):
    flame.manual_seed(0)
    return Tiny(device=device)
