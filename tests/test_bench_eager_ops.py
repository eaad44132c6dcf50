"""bench/eager_ops.py's FLAME side runs every op on the cpu (the GPU call that measures them does not fail on the
script), each returning what PyTorch's op returns in shape."""
import os
import sys

import flame_core as flame
import flame_nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import eager_ops  # noqa: E402

SHAPES = {"view": (8, 512), "stack": (2, 8, 16, 32), "cat": (8, 32, 32), "sdpa": (1, 8, 16, 32), "conv2d": (2, 8, 8, 8),
          "embedding": (8, 4, 32), "mean(dim)": (8, 16, 1), "mse_loss": (), "matmul bmm": (8, 16, 16)}


def test_every_op_of_the_bench_runs_on_the_cpu():
    ops = eager_ops.cases(flame, F, "cpu")
    assert len(ops) == 35
    for name, fn in ops.items():
        out = fn()
        if name in SHAPES:
            assert tuple(out.shape) == SHAPES[name], name
    assert eager_ops.per_call(ops["view"], lambda: None, n=3, rep=2) > 0
