"""Runs the kernels that bench/kernels.py finds short of their targets a few times each, for Nsight Compute:
  ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
      -k regex:'norm_bwd|gn_fwd|column_sum' python3 bench/ncu_probe.py
(rms_norm backward with dweight, LayerNorm backward with dweight and dbias, the dx-only LayerNorm backward,
GroupNorm forward)."""
import sys

sys.path.insert(0, "bench")
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402
from flame_core.kernels import loader as L, norms as K  # noqa: E402

cp = B.cp
x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
w = B.randn((3072,)) + 1
_, rs = K.rms_norm_forward(x, w, 1e-6)
_, mean, rstd = K.layer_norm_forward(x, None, None, 1e-6)
g = B.randn((2, 320, 128, 128))
for _ in range(2):
    K.rms_norm_backward(dy, x, w, rs)                      # norm_bwd_tma (dw) + column_sum
    K.layer_norm_backward(dy, x, w, mean, rstd, w)         # norm_bwd_tma (dw, db) + column_sum
    K.layer_norm_backward(dy, x, None, mean, rstd)         # norm_bwdx2 (dx only)
    K.group_norm_forward(g, 32, None, None, 1e-5)          # gn_fwd_cluster
cp.cuda.Device().synchronize()
print("done")
