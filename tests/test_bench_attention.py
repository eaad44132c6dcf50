"""bench/attention.py's variants on the CPU: the forward's "schedule[:BNxNWGxSTAGES]" and the backward's
"variant[@NWGxSTAGESxBM]" entries parse into the module switches and the tiles the kernels take, and entries that
cannot run are refused with what is wrong."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import attention  # noqa: E402


def test_schedules_and_tiles_parse():
    assert attention.parse_fwd_variant("plain", 128) == (False, True, False, None)
    assert attention.parse_fwd_variant("pingpong:128x2x3", 128) == (True, True, False, (128, 2, 3))
    assert attention.parse_fwd_variant("overlap", 128) == (False, True, True, None)
    assert attention.parse_fwd_variant("cpasync:64x1x4", 64) == (False, False, False, (64, 1, 4))


@pytest.mark.parametrize("entry, words", [
    ("fast", "unknown schedule 'fast'"),
    ("plain:128x2", "must be BNxNWGxSTAGES"),
    ("plain:96x2x2", "must be BNxNWGxSTAGES"),        # BN not a multiple of 64
    ("plain:128x3x2", "must be BNxNWGxSTAGES"),       # three consumer warpgroups
    ("plain:128x2x4", "296000 bytes of shared memory"),  # four stages of 128 keys at head dim 128
])
def test_entries_the_kernel_cannot_run_are_refused(entry, words):
    with pytest.raises(ValueError, match=words):
        attention.parse_fwd_variant(entry, 128)


def test_three_stages_of_128_keys_fit_at_head_dim_128():
    # (128 query rows + 2 x 3 x 128 keys) x 128 x 2 bytes + alignment: under the 232448 bytes a block gets
    assert attention.parse_fwd_variant("plain:128x2x3", 128)[-1] == (128, 2, 3)


def test_the_variants_name_module_switches_that_exist():
    from flame_core.kernels import attention as A
    for name in attention.FWD_SWITCHES:
        assert isinstance(getattr(A, name), bool), name
    assert all(len(v) == len(attention.FWD_SWITCHES) for v in attention.FWD_VARIANTS.values())


def test_backward_variants_parse_into_switches_and_tiles():
    from flame_core.kernels import attention as A
    cost = A.TAIL_PIECE_COST
    assert attention._bwd_variant("plain") == (False, cost, True, None)
    assert attention._bwd_variant("tail") == (True, cost, True, None)
    assert attention._bwd_variant("cpasync") == (True, cost, False, None)
    assert attention._bwd_variant("tail:0.06") == (True, 0.06, True, None)
    assert attention._bwd_variant("tail@2x3x64") == (True, cost, True, (2, 3, 64))
    assert attention._bwd_variant("plain@2x2x128") == (False, cost, True, (2, 2, 128))


@pytest.mark.parametrize("entry, words", [("fast", "unknown variant 'fast'"), ("tail@2x3", "NWGxSTAGESxBM"),
                                          ("tail@2xtwox64", "NWGxSTAGESxBM"), ("tail@3x2x64", "NWG 1 or 2"),
                                          ("plain@2x2x96", "BM 64 or 128")])
def test_backward_entries_that_do_not_parse_are_refused(entry, words):
    with pytest.raises(ValueError, match=words):
        attention._bwd_variant(entry)
