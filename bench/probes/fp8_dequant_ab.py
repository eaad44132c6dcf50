# ruff: noqa -- a one-off device probe kept in history only (removed in the next commit)
"""A/B: eager fp8-storage T5-XXL wall ms (fused projections), one tree per process; first run saves the peer."""
import os, statistics, sys, time
import numpy as np
D = "/tmp/t5xxl_rand"
if sys.argv[1] == "save":
    import torch, transformers
    cfg = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        peer = transformers.T5EncoderModel._from_config(transformers.T5Config(**cfg), dtype=torch.bfloat16).eval()
    peer.save_pretrained(D)
    sys.exit(0)
import cupy
import flame_core as flame
from flame_models.text_encoders import load_t5
import ml_dtypes
import flame_nn.offload.fp8 as F8
from flame_core.kernels import fp8 as K
qq, ss = K.quantize_per_row(cupy.random.standard_normal((256, 256), dtype=cupy.float32))
bf = np.dtype(ml_dtypes.bfloat16)
for _ in range(100): F8._dequantize_into_scratch(qq, ss, bf)
cupy.cuda.Device().synchronize()
us = []
for r in range(7):
    t = time.perf_counter()
    for _ in range(3000): F8._dequantize_into_scratch(qq, ss, bf)
    us.append((time.perf_counter() - t) / 3000 * 1e6); cupy.cuda.Device().synchronize()
print(f"\nAB {sys.argv[1]} dequant-into-scratch host us/call {sorted(us)[3]:.2f} {[round(u,2) for u in us]}", flush=True)
ids = np.random.default_rng(0).integers(2, 32000, (1, 512)).astype(np.int64)
xf = flame.tensor(ids, device="cuda")
fs = cupy.cuda.Device().synchronize
def wall(fn, n=10):
    fn(); fs(); out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); fs(); out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)
def host(fn, n=10):  # host time of one call, the GPU drained before each
    fn(); fs(); out = []
    for _ in range(n):
        fs(); t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e3); fs()
    return statistics.median(out)
with flame.no_grad():
    m = load_t5(D, dtype=flame.bfloat16, device="cuda", quantize="fp8")
    F = lambda: m(xf, output_hidden_states=True)
    w = [wall(F) for _ in range(3)]
    h = [host(F) for _ in range(3)]
print(f"\nAB {sys.argv[1]} wall {statistics.median(w):.2f} {[round(v,2) for v in w]} host {statistics.median(h):.2f}", flush=True)
