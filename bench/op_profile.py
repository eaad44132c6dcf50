"""Where a step's time goes, op by op (flame_core.profiler): host ms and device ms per op and phase.

Workloads:
  stack  one plain training step of bench/checkpoint.py's transformer stack (bf16 autocast, AdamW)
  flux   a Flux-dev-size model cut to --double double and --single single blocks, LoRA r16 on the attention
         projections (as the PEERS.md setup), bf16 weights, bf16 autocast, forward + backward at --size (1024: 4096
         image + 512 text tokens)
Each workload runs warm-up steps first, then one timed step (CUDA events around it) and one profiled step.
Run: PYTHONPATH=$PWD python3 bench/op_profile.py [stack] [flux] [--size 1024]
"""
import argparse
import importlib.util
import os
import sys
import time

import numpy as np

import flame_core as flame
from flame_core import amp, backend, profiler

HERE = os.path.dirname(os.path.abspath(__file__))


def _sync():
    if backend.cuda_available():
        backend.cupy.cuda.Device().synchronize()


def _time(fn):
    cp = backend.cupy
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    t = time.perf_counter()
    fn()
    host = time.perf_counter() - t
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b), host * 1e3


def _report(name, fn, warmup=2):
    for _ in range(warmup):
        fn()
    _sync()
    dev_ms, host_ms = _time(fn)
    with profiler.profile() as prof:
        fn()
    print(f"\n== {name}: step {dev_ms:.2f} ms on the GPU, {host_ms:.2f} ms to issue on the host", flush=True)
    print(prof.table(limit=45), flush=True)


def stack_workload(args):
    spec = importlib.util.spec_from_file_location("ckpt_bench", os.path.join(HERE, "checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dev = flame.device("cuda")
    flame.manual_seed(0)
    model = mod.Stack(16, 1024, 16, dev, 0.1)
    params = model.parameters()
    opt, _ = mod.make_optimizer(params, 3e-4)
    rng = np.random.default_rng(1)
    x = flame.tensor(rng.standard_normal((2, 1024, 1024)).astype(np.float32), device=dev)
    target = flame.tensor(rng.standard_normal((2, 1024, 1024)).astype(np.float32) * 0.5, device=dev)

    def step():
        with amp.autocast("cuda", dtype=flame.bfloat16):
            y = model(x)
        loss = ((y.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    _report("stack (16 blocks, dim 1024, seq 1024, batch 2)", step)


def flux_workload(args):
    import flame_nn
    from flame_nn import adapters as A
    from flame_models.flux import sampling as S
    from flame_models.flux.params import configs
    from flame_models.flux.lora_keys import name_map_for
    p = configs["flux-dev"].replace(depth=args.double, depth_single_blocks=args.single)
    sys.path.insert(0, HERE)
    from flux_random import random_flux
    model = random_flux(p)
    g = flame.Generator("cuda").manual_seed(0)
    model.requires_grad_(False)
    A.inject_adapters(model, ["to_q", "to_k", "to_v", "to_out.0"], "lora", rank=16, alpha=16,
                      name_map=name_map_for(p))
    lora = A.adapter_parameters(model)
    opt = flame_nn.optim.AdamW(lora, lr=1e-4)
    model.enable_gradient_checkpointing(args.checkpointing)
    tokens = (args.size // 16) ** 2

    def rnd(*shape):
        return flame.randn(*shape, generator=g, device="cuda").to(flame.bfloat16)
    kw = dict(img=rnd(1, tokens, 64), img_ids=S.image_ids(args.size, args.size, device="cuda"),
              txt=rnd(1, 512, 4096), txt_ids=S.text_ids(512, device="cuda"), y=rnd(1, 768),
              timesteps=flame.tensor([0.6], device="cuda"), guidance=flame.tensor([1.0], device="cuda"))
    target = rnd(1, tokens, 64).float()

    def step():
        with amp.autocast("cuda", dtype=flame.bfloat16):
            pred = model(**kw)
        loss = ((pred.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    _report(f"flux-dev dims, {args.double} double + {args.single} single blocks, LoRA r16 attn, {args.size}^2, "
            f"checkpointing {'on' if args.checkpointing else 'off'}", step)


def torch_saved(args):
    """The same count for diffusers' FluxTransformer2DModel + PEFT (saved_tensors_hooks; storages counted once)."""
    try:
        import torch
        from diffusers import FluxTransformer2DModel
        from peft import LoraConfig
    except ImportError as e:
        print(f"(diffusers saved-tensor count skipped: {e})")
        return
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=args.double,
                                   num_single_layers=args.single, attention_head_dim=128, num_attention_heads=24,
                                   joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                                   axes_dims_rope=(16, 56, 56))
    torch.set_default_dtype(torch.float32)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian",
                             target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for q in m.parameters():
        if q.requires_grad:
            q.data = q.data.float()
    params = {q.untyped_storage().data_ptr() for q in m.parameters()}
    tokens, side = (args.size // 16) ** 2, args.size // 16
    img_ids = torch.zeros(side, side, 3, device="cuda")
    img_ids[..., 1] = torch.arange(side, device="cuda")[:, None]
    img_ids[..., 2] = torch.arange(side, device="cuda")[None, :]
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            total[0] += st.nbytes()
        return t
    torch.backends.cuda.enable_cudnn_sdp(False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(hidden_states=torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16),
                    encoder_hidden_states=torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16),
                    pooled_projections=torch.randn(1, 768, device="cuda", dtype=torch.bfloat16),
                    timestep=torch.full((1,), 0.6, device="cuda", dtype=torch.bfloat16),
                    img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(512, 3, device="cuda"),
                    guidance=torch.full((1,), 1.0, device="cuda", dtype=torch.bfloat16), return_dict=False)[0]
        loss = (out.float() ** 2).mean()
    print(f"== diffusers+PEFT saved for backward (same blocks): {total[0] / 2 ** 20:.1f} MiB", flush=True)
    del m, out, loss
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=["stack", "flux"])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--saved", action="store_true", help="bytes kept for backward by op, and diffusers' total")
    args = ap.parse_args()
    if not backend.cuda_available():
        sys.exit("op_profile needs a CUDA GPU")
    for w in args.workloads:
        {"stack": stack_workload, "flux": flux_workload}[w](args)


if __name__ == "__main__":
    main()
