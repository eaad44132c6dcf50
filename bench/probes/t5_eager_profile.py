# ruff: noqa -- a one-off device probe kept in history only (removed in the next commit)
"""Probe: host cost of FLAME's eager bf16 T5-XXL (random weights, 512 tokens): wall vs host ms, then cProfile."""
import cProfile, pstats, statistics, sys, time, os
import numpy as np
D = "/tmp/t5xxl_rand"
if not os.path.isdir(D):
    import torch, transformers
    cfg = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        peer = transformers.T5EncoderModel._from_config(transformers.T5Config(**cfg), dtype=torch.bfloat16).eval()
    peer.save_pretrained(D)
    del peer
import cupy
import flame_core as flame
from flame_models.text_encoders import load_t5
ids = np.random.default_rng(0).integers(2, 32000, (1, 512)).astype(np.int64)
xf = flame.tensor(ids, device="cuda")
fs = cupy.cuda.Device().synchronize
with flame.no_grad():
    m = load_t5(D, dtype=flame.bfloat16, device="cuda")
    F = lambda: m(xf)
    for _ in range(3): F()
    fs()
    w, h = [], []
    for _ in range(10):
        fs(); t = time.perf_counter(); F(); h.append((time.perf_counter() - t) * 1e3); fs(); w.append((time.perf_counter() - t) * 1e3)
    print(f"\nT5 bf16 eager: wall {statistics.median(w):.2f} ms, host {statistics.median(h):.2f} ms", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5): F()
    pr.disable(); fs()
st = pstats.Stats(pr)
print(f"\ncalls per T5 call: {st.total_calls / 5:.0f}")
st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumtime").print_stats(45)
