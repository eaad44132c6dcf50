"""Flux-dev-size LoRA training step: FLAME side by side with diffusers + PEFT in the same process.

11.9B-parameter Flux-dev, random init, bf16 frozen base; LoRA r=16 alpha=16 on the attention projections (diffusers
names to_q / to_k / to_v / to_out.0; in FLAME the same rows of BFL's fused qkv and the proj Linears); fp32 adapter
parameters; AdamW lr 1e-4; bf16 autocast; batch 1; T5 length 512; guidance 1.0; MSE against a random target.
Sizes 512x512 (1024 image tokens) and 1024x1024 (4096), gradient checkpointing on and off.

Timing and memory: bench/lora_step.py's protocol.
--quantize bf16,fp8,fp8_compute: FLAME's frozen blocks as they are (bf16), in fp8 storage (dequantised per matmul), or
in fp8 with fp8 compute (e4m3 tensor-core GEMMs, flame_nn.offload.fp8_compute); one FLAME row per variant.
Run: PYTHONPATH=$PWD python3 bench/flux_lora.py [--sizes 512,1024] [--ckpt on,off] [--repeats 5] [--graph]
     [--quantize bf16,fp8_compute]
"""
import common
import lora_step


def flame_part(res, configs, repeats, warmup, blocks=None, graph=False, quantize="bf16", cache_transposes=False):
    from flame_models.flux.lora_keys import name_map_for
    from flame_models.flux.params import configs as presets
    p = presets["flux-dev"] if not blocks else presets["flux-dev"].replace(depth=blocks[0],
                                                                            depth_single_blocks=blocks[1])
    model = common.random_flux(p)
    model.requires_grad_(False)
    lora_step.quantize_blocks((model.double_blocks, model.single_blocks), quantize, cache_transposes)

    def make_step(size):
        kw, target = common.flame_flux_inputs(size, guidance=1.0)
        return common.flame_flux_loss_step(model, kw), (kw["img"], kw["txt"], kw["y"], target)
    lora_step.flame_steps(res, model, name_map_for(p), configs, make_step, repeats, warmup, graph,
                          prefix=lora_step.variant_prefix(quantize))
    model = None  # rebound, not deleted: closures above use the names
    lora_step.release_flame()


def diffusers_part(res, configs, repeats, warmup, blocks=None, peers=("eager",)):
    import torch
    model = common.diffusers_flux(blocks)

    def make_inputs(size):
        kw = common.diffusers_inputs(size, guidance=1.0)
        return (lambda: model(**kw)[0]), torch.randn_like(kw["hidden_states"])
    lora_step.diffusers_steps(res, model, configs, make_inputs, repeats, warmup, peers=peers)


def main():
    ap = lora_step.parser(__doc__, sizes="512,1024", quantize=True)
    ap.add_argument("--blocks", default=None, help="double,single block counts (default: flux-dev's 19,38)")
    a = ap.parse_args()
    configs = lora_step.configs_from(a.sizes, a.ckpt)
    blocks = tuple(int(v) for v in a.blocks.split(",")) if a.blocks else None
    res = common.Results("flux_lora")
    ours = [(f"FLAME {q}", lambda q=q: flame_part(res, configs, a.repeats, a.warmup, blocks, a.graph, q,
                                                        a.fp8_cache_transposes))
            for q in a.quantize]
    title = ("\nFlux-dev LoRA r16 (attention) training step, bf16 autocast, batch 1, T5 512 (median ms; peak "
             "allocated GiB)" + lora_step.graph_note(a))
    reports = [lambda q=q: lora_step.report(res, configs, title + lora_step.variant_note(q, a.fp8_cache_transposes),
                                            flame_prefix=lora_step.variant_prefix(q)) for q in a.quantize]
    lora_step.run(res, a, ours,
                  [("diffusers+PEFT", lambda: diffusers_part(res, configs, a.repeats, a.warmup, blocks, a.peer))],
                  reports)


if __name__ == "__main__":
    main()
