"""Single-head attention over the mid block's H*W tokens with head dim C (512 in the released VAEs).

The flash kernels stop at head dim 256, so at 1024^2 (16384 tokens) this is computed a block of query rows at a time,
never holding the 16384^2 score matrix: scores and softmax in float32, then P (rounded to the inputs' dtype, as a
flash kernel does) times V on the half-precision tensor cores. With gradients recorded it is
scaled_dot_product_attention (its chunked path has a memory-efficient backward).
"""
import flame_core as flame
import flame_nn.functional as F

CHUNK_BYTES = 64 << 20  # float32 scores held at a time


def single_head_attention(q, k, v, chunk_bytes=CHUNK_BYTES):
    """softmax(q k^T / sqrt(C)) v for q, k, v (B, L, C) -> (B, L, C) in q's dtype."""
    if flame.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
    B, L, C = q.shape
    cd = flame.float64 if q.dtype == flame.float64 else flame.float32
    scale = C ** -0.5
    kT = k.to(cd).transpose(1, 2)                               # (B, C, L)
    rows = max(1, min(L, chunk_bytes // max(1, B * k.shape[1] * 4)))
    out = []
    for i in range(0, L, rows):
        s = flame.matmul(q[:, i:i + rows].to(cd) * scale, kT)     # (B, R, L) scores
        s -= s.amax(dim=-1, keepdim=True)
        p = s.exp()
        del s
        denom = p.sum(dim=-1, keepdim=True)                     # (B, R, 1), float32
        o = flame.matmul(p.to(v.dtype), v)                      # (B, R, C)
        del p
        out.append((o.to(cd) / denom).to(q.dtype))
    return out[0] if len(out) == 1 else flame.cat(out, dim=1)
