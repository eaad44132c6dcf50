# ruff: noqa -- a one-off device probe kept in history only (removed in the next commit)
"""A/B in one process: FLAME's eager bf16 T5-XXL with masked attention plans kept (new) vs not kept (as before)."""
import statistics, time, os
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
from flame_core.kernels import attention as K
from flame_models.text_encoders import load_t5
ids = np.random.default_rng(0).integers(2, 32000, (1, 512)).astype(np.int64)
xf = flame.tensor(ids, device="cuda")
fs = cupy.cuda.Device().synchronize
class Unmasked(dict):  # keeps only unmasked plans: the masked forward as before this change
    def __setitem__(self, key, value):
        if key[-1] is None:
            dict.__setitem__(self, key, value)
def timed(F, n=10):
    F(); fs(); w, h = [], []
    for _ in range(n):
        fs(); t = time.perf_counter(); F(); h.append((time.perf_counter() - t) * 1e3); fs(); w.append((time.perf_counter() - t) * 1e3)
    return statistics.median(w), statistics.median(h)
with flame.no_grad():
    for quant in (None, "fp8"):
        m = load_t5(D, dtype=flame.bfloat16, device="cuda", quantize=quant)
        F = lambda: m(xf)
        outs = {}
        res = {"kept": [], "before": []}
        for r in range(6):
            for k in (("kept", "before") if r % 2 == 0 else ("before", "kept")):
                K._fwd_plans = {} if k == "kept" else Unmasked()
                res[k].append(timed(F))
                outs[k] = m(xf).last_hidden_state.float().numpy()
        same = bool((outs["kept"] == outs["before"]).all())
        print(f"\nT5 {quant or 'bf16'} eager wall/host ms: " + ", ".join(
            f"{k} {statistics.median(a for a, _ in v):.2f}/{statistics.median(b for _, b in v):.2f}" for k, v in res.items())
            + f"  outputs bit-equal: {same}", flush=True)
        m = F = None
        import gc; gc.collect()
