"""SDXL UNet LoRA training step at 1024²: FLAME side by side with diffusers + PEFT in the same process (issue 29).

The SDXL base UNet (2.57B; 320/640/1280 channels, 1/2/10 transformer layers, 77x2048 context, text_time size
embedding), bench/lora_step.py's protocol (random bf16 base, LoRA r16 on to_q/to_k/to_v/to_out.0 of every attention,
fp32 adapters, AdamW, bf16 autocast, batch 1), latents 4x128x128, t = 500, gradient checkpointing on and off.
The SDXL VAE's encode / decode at 1024² are bench/pipeline.py's `vae` part.
--full: full fine-tuning instead (every UNet weight trains in float32 under bf16 autocast, AdamW -- fused on both
sides --, diffusers' full fine-tuning recipe with mixed_precision bf16 as the peer).
Run: PYTHONPATH=$PWD python3 bench/sdxl_lora.py [--ckpt on,off] [--repeats 5] [--graph] [--skip-diffusers] [--full]
"""
import common
import lora_step


def flame_part(res, configs, a):
    import flame_core as flame
    model, name_map = lora_step.family_model("sdxl", "sdxl-base")
    bf16 = dict(dtype=flame.bfloat16)

    def make_step(px):
        g = flame.Generator("cuda").manual_seed(1)
        side = px // 8
        x = flame.randn(1, 4, side, side, generator=g, device="cuda").to(**bf16)
        ctx = flame.randn(1, 77, 2048, generator=g, device="cuda").to(**bf16)
        y = flame.randn(1, 2816, generator=g, device="cuda").to(**bf16)
        t = flame.tensor([500.0], device="cuda")
        target = flame.randn(1, 4, side, side, generator=g, device="cuda")
        return lora_step.flame_loss(model), (x, t, ctx, y, target)
    lora_step.flame_steps(res, model, name_map, configs, make_step, a.repeats, a.warmup, a.graph, full=a.full)
    model = None  # rebound, not deleted: closures above use the names
    lora_step.release_flame()


DIFFUSERS_CONFIG = dict(
    sample_size=128, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(320, 640, 1280),
    layers_per_block=2, transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816)


def diffusers_part(res, configs, a):
    import torch
    from diffusers import UNet2DConditionModel
    model = lora_step.build_torch(UNet2DConditionModel, **DIFFUSERS_CONFIG)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def make_inputs(px):
        side = px // 8
        x = torch.randn(1, 4, side, side, **bf16)
        ctx, pooled = torch.randn(1, 77, 2048, **bf16), torch.randn(1, 1280, **bf16)
        time_ids = torch.tensor([[px, px, 0, 0, px, px]], **bf16)
        t = torch.tensor([500], device="cuda")
        return (lambda: model(x, t, encoder_hidden_states=ctx,
                              added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]), \
            torch.randn_like(x)
    lora_step.diffusers_steps(res, model, configs, make_inputs, a.repeats, a.warmup, peers=a.peer, full=a.full)


def main():
    a = lora_step.parser(__doc__).parse_args()
    configs = lora_step.configs_from(a.sizes, a.ckpt)
    res = common.Results("sdxl_full" if a.full else "sdxl_lora")
    lora_step.run(res, a, [("FLAME", lambda: flame_part(res, configs, a))],
                  [("diffusers+PEFT", lambda: diffusers_part(res, configs, a))],
                  [lambda: lora_step.report(res, configs, "\nSDXL UNet " + (
                      "full fine-tuning (float32 weights, AdamW)" if a.full else "LoRA r16 (attention)")
                      + " step, bf16 autocast, batch 1, 77x2048 context (median ms; peak allocated GiB)"
                      + lora_step.graph_note(a))])


if __name__ == "__main__":
    main()
