"""Sweep of the norm kernels' launch plans on the GPU (same protocol as bench/kernels.py: L2 evicted, each call timed
alone, median). Run: PYTHONPATH=$PWD python3 bench/norm_sweep.py (tuning aid: the fastest plans become the defaults in
flame_core/kernels/norms.py)"""
import sys
sys.argv = sys.argv[:1]
import numpy as np
sys.path.insert(0, "bench")
import kernels as B  # bench/kernels.py: time_ms, randn
from flame_core.kernels import loader as L, modulate as M, norms as K

x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
w, b = B.randn((3072,)) + 1, B.randn((3072,))
q, wq = B.randn((110592, 128)), B.randn((128,)) + 1
_, mean, rstd = K.layer_norm_forward(x, None, None, 1e-6)
_, rs = K.rms_norm_forward(x, w, 1e-6)
_, rq = K.rms_norm_forward(q, wq, 1e-6)
copy = B.time_ms(lambda: B.cp.copyto(B.cp.empty_like(x), x))
print(f"copy 4608x3072 bf16: {copy:.4f} ms")
fwd = {"ln": lambda: K.layer_norm_forward(x, None, None, 1e-6), "ln_aff": lambda: K.layer_norm_forward(x, w, b, 1e-5),
       "rms": lambda: K.rms_norm_forward(x, w, 1e-6)}
print("default fwd plans: 3072 cols", K._fwd_shape(3072 // 8), "128 cols", K._fwd_shape(128 // 8))
for plan in [None, (12, 32), (16, 32), (8, 64), (6, 64), (4, 96), (3, 128), (2, 192), (1, 384)]:
    K.fwd_override = plan
    print("fwd", plan, {k: round(B.time_ms(f), 4) for k, f in fwd.items()})
for plan in [None, (4, 4), (2, 8), (8, 2), (1, 16), (16, 1), (2, 16), (4, 8)]:
    K.fwd_override = plan
    print("qk fwd", plan, round(B.time_ms(lambda: K.rms_norm_forward(q, wq, 1e-6)), 4))
K.fwd_override = None
for fused in (True, False):  # weight grads summed in the backward kernel (one launch) or by column_sum launches
    K.single_launch_sums = M.single_launch_sums = fused
    for v in [None, 1, 2, 4]:
        L.vpt_override = v
        print("bwd", "fused" if fused else "column_sum", "vpt", v,
              "rms", round(B.time_ms(lambda: K.rms_norm_backward(dy, x, w, rs)), 4),
              "ln", round(B.time_ms(lambda: K.layer_norm_backward(dy, x, None, mean, rstd)), 4),
              "ln_aff", round(B.time_ms(lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b)), 4))
    L.vpt_override = None
    print("bwd", "fused" if fused else "column_sum", "qk rms (weight)",
          round(B.time_ms(lambda: K.rms_norm_backward(q, q, wq, rq)), 4))
    x3, dy3 = x.reshape(1, 4608, 3072), dy.reshape(1, 4608, 3072)
    sh, sc = B.randn((1, 1, 3072)), B.randn((1, 1, 3072), scale=0.3)
    print("bwd", "fused" if fused else "column_sum",
          "modulate", round(B.time_ms(lambda: M.modulate_backward(dy3, x3, sh, sc)), 4),
          "gated", round(B.time_ms(lambda: M.gated_residual_backward(dy3, sh, x3)), 4))
K.single_launch_sums = M.single_launch_sums = True
g, gdy = B.randn((2, 320, 128, 128)), B.randn((2, 320, 128, 128))
_, gm, gr = K.group_norm_forward(g, 32, None, None, 1e-5)
gw, gb = B.randn((320,), np.float32) + 1, B.randn((320,), np.float32)
for cl in (True, False):
    K.use_cluster = cl
    print("gn cluster" if cl else "gn split", "fwd", round(B.time_ms(lambda: K.group_norm_forward(g, 32, None, None, 1e-5)), 4),
          "bwd", round(B.time_ms(lambda: K.group_norm_backward(gdy, g, 32, None, gm, gr)), 4),
          "bwd affine", round(B.time_ms(lambda: K.group_norm_backward(gdy, g, 32, gw, gm, gr, gb)), 4))
