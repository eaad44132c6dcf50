"""bench/lora_step.py's --fp8-cache-transposes on the CPU: parsed by the step benches' parser, applied by
quantize_blocks to the fp8-compute variants only (the bytes it returns), named in the report title. The timed runs
need the GPU."""
import os
import sys

import pytest

import flame_nn as nn
from flame_nn.offload.fp8_transposes import cached_transposes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import lora_step  # noqa: E402


def _stacks(device):
    stack = nn.ModuleList([nn.Linear(32, 64, device=device), nn.Linear(64, 32, device=device)])
    stack.requires_grad_(False)
    return [stack]


def test_the_flag_parses_and_defaults_off():
    ap = lora_step.parser(__doc__, quantize=True)
    assert ap.parse_args([]).fp8_cache_transposes is False
    a = ap.parse_args(["--quantize", "fp8_compute,fp8_delayed", "--fp8-cache-transposes"])
    assert a.fp8_cache_transposes is True and a.quantize == ("fp8_compute", "fp8_delayed")
    with pytest.raises(SystemExit):
        lora_step.parser(__doc__).parse_args(["--fp8-cache-transposes"])   # a bench without --quantize variants


@pytest.mark.parametrize("quantize,cached", [("bf16", False), ("fp8", False), ("fp8_compute", True),
                                             ("fp8_delayed", True)])
def test_quantize_blocks_caches_the_fp8_compute_variants_only(device, quantize, cached):
    stacks = _stacks(device)
    held = lora_step.quantize_blocks(stacks, quantize, cache_transposes=True)
    assert held == (2 * 32 * 64 if cached else 0)
    assert len(cached_transposes(stacks[0])) == (2 if cached else 0)
    assert lora_step.quantize_blocks(_stacks(device), quantize) == 0      # the flag off: nothing held
    note = lora_step.variant_note(quantize, True)
    assert ("W^T cached" in note) is cached
