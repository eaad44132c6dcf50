"""The built-in demo's inputs, made at run time: a folder of procedurally drawn images with captions, and a tiny Flux
model folder (diffusers layout) whose VAE means something.

    images = draw_dataset("runs/demo/images")        # 24 PNGs + captions: 12 of the concept, 12 other shapes
    model = tiny_model_folder("runs/demo/model")      # FluxFiles of the tiny model

The concept: TRIGGER ("ohwx") is a red-and-white bullseye; the captions of its images are "[trigger] on a <colour>
background" (the trainer puts the trigger word in), the others "a <colour> <shape> on a <colour> background". A
LoRA that learned the concept draws the bullseye for prompts with the trigger word, and a shape otherwise.

The model: flame_models.flux.tiny's random CLIP and T5 with tokenizers learned from a corpus that includes the
demo's words; the VAE is analytic_vae's: its weights are SET BY HAND so that it encodes by average pooling and
decodes by nearest upsampling (a random VAE would decode noise), so previews show images as 8x8-pixel squares,
exactly what this VAE can represent. The transformer is PRETRAINED AT RUN TIME (all its weights, a few hundred
steps) on the shape images only, standing in for a real base model: a LoRA adjusts a model that can already draw,
and this one has never seen the bullseye or the trigger word when the LoRA training starts.
"""
import os

import numpy as np

TRIGGER = "ohwx"
CONCEPT = "a red-and-white bullseye"
BACKGROUNDS = {"blue": (40, 70, 200), "green": (40, 150, 60), "purple": (120, 50, 160), "grey": (128, 128, 128),
               "yellow": (225, 200, 40), "teal": (30, 150, 150)}
SHAPE_COLOURS = {"yellow": (240, 210, 30), "blue": (40, 80, 230), "orange": (240, 130, 20), "white": (245, 245, 245)}
SHAPES = ("square", "circle", "triangle")
PROMPTS = ["[trigger] on a blue background", "[trigger] on a grey background", "a yellow square on a purple background"]


def _bullseye(draw, cx, cy, r):
    for k, colour in enumerate([(220, 30, 30), (245, 245, 245), (220, 30, 30)]):
        rr = r * (1 - k / 3)
        draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=colour)


def _shape(draw, kind, cx, cy, r, colour):
    if kind == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)


def draw_dataset(folder, n_concept=12, n_other=12, size=128, seed=0):
    """Write the demo's images (PNG) and captions (.txt) into `folder`; returns the folder."""
    from PIL import Image, ImageDraw
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    bgs, cols = list(BACKGROUNDS), list(SHAPE_COLOURS)
    items = []
    for i in range(n_concept):
        bg = bgs[i % len(bgs)]
        items.append((f"concept_{i:02d}", bg, None, None, "[trigger] on a " + bg + " background"))
    for i in range(n_other):
        bg, col, shape = bgs[(i + 2) % len(bgs)], cols[i % len(cols)], SHAPES[i % len(SHAPES)]
        if col == bg:
            col = "white"
        items.append((f"shape_{i:02d}", bg, col, shape, f"a {col} {shape} on a {bg} background"))
    for name, bg, col, shape, caption in items:
        im = Image.new("RGB", (size, size), BACKGROUNDS[bg])
        d = ImageDraw.Draw(im)
        cx, cy = size / 2 + rng.uniform(-1, 1) * size / 16, size / 2 + rng.uniform(-1, 1) * size / 16
        r = size * rng.uniform(0.3, 0.36)
        if shape is None:
            _bullseye(d, cx, cy, r)
        else:
            _shape(d, shape, cx, cy, r * 0.8, SHAPE_COLOURS[col])
        im.save(os.path.join(folder, name + ".png"))
        with open(os.path.join(folder, name + ".txt"), "w") as f:
            f.write(caption + "\n")
    return folder


def corpus():
    """Text for the tiny tokenizers: flux.tiny's corpus plus every word the demo's captions and prompts use."""
    from .tiny import TINY_CORPUS
    words = [f"{TRIGGER} on a {bg} background" for bg in BACKGROUNDS]
    words += [f"a {c} {s} on a {bg} background" for c in SHAPE_COLOURS for s in SHAPES for bg in BACKGROUNDS]
    return list(TINY_CORPUS) + words


def tiny_model_folder(folder, images=None, *, base_steps=300, device="cpu", seed=0, max_length=16, progress=True):
    """A tiny Flux model folder (diffusers layout): random CLIP / T5, tokenizers learned from corpus(), the analytic
    pooling VAE, and the transformer pretrained for `base_steps` on the shape images of `images` (the images'
    folder; None or 0 steps: random). Returns its FluxFiles."""
    from ..training.analytic_vae import analytic_vae
    from .tiny import save_flux_folder, tiny_flux_parts
    parts = tiny_flux_parts(seed, corpus=corpus())
    parts["vae"] = analytic_vae()
    if images is not None and base_steps:
        pretrain_base(parts, images, steps=base_steps, device=device, seed=seed, max_length=max_length,
                      progress=progress)
    return save_flux_folder(folder, parts)


def pretrain_base(parts, images, *, steps=300, batch_size=8, lr=2e-3, device="cpu", seed=0, max_length=16,
                  progress=True):
    """Train every weight of parts["transformer"] with the flow-matching loss on the `shape_*` images of the folder
    `images` (their captions), as a base model is trained before anyone fine-tunes it. In place; returns the
    losses."""
    from tqdm import tqdm

    import flame_core as flame
    import flame_nn

    from ..training.objective import FlowMatching
    from . import pack
    from .conditioning import FluxTextEncoders
    from .pipeline import encode_images
    from .sampling import image_ids, text_ids
    names = sorted(f for f in os.listdir(images) if f.startswith("shape_") and f.endswith(".png"))
    pixels, captions = [], []
    from ..data import image_array, load_image
    for f in names:
        pixels.append(image_array(load_image(os.path.join(images, f))))
        with open(os.path.join(images, f[:-4] + ".txt")) as fh:
            captions.append(fh.read().strip())
    dev = flame.device(device)
    with flame.no_grad():
        latents = encode_images(parts["vae"], flame.tensor(np.stack(pixels)))          # (N, 16, h, w)
        enc = FluxTextEncoders(parts["clip_l"], parts["t5"], parts["clip_tokenizer"], parts["t5_tokenizer"],
                               max_length=max_length)
        cond = enc.encode(captions)
    x_all = pack(latents).to(dev)                                                      # (N, L, 64)
    txt_all, y_all = cond["prompt_embeds"].float().to(dev), cond["pooled_prompt_embeds"].float().to(dev)
    model = parts["transformer"].to(dev)
    model.requires_grad_(True)
    model.train()
    params = list(model.parameters())
    opt = flame_nn.optim.AdamW(params, lr=lr, weight_decay=0.0)
    objective = FlowMatching("sigmoid")
    rng = np.random.default_rng(seed)
    g_noise, g_t = flame.Generator(dev).manual_seed(seed), flame.Generator("cpu").manual_seed(seed)
    H, W = latents.shape[2] * 8, latents.shape[3] * 8
    B = min(batch_size, len(names))
    img_pos, txt_pos = image_ids(H, W, B, device=dev), text_ids(txt_all.shape[1], B, device=dev)
    guidance = flame.full((B,), 1.0, device=dev)
    losses = []
    for _ in tqdm(range(steps), desc="pretraining the tiny base model", disable=not progress, leave=False):
        idx = flame.tensor(rng.choice(len(names), B, replace=False), device=dev)
        x0, txt, y = x_all[idx], txt_all[idx], y_all[idx]
        noise = flame.randn(*x0.shape, generator=g_noise, device=dev)
        t = objective.sample_timesteps(B, generator=g_t, num_tokens=x0.shape[1], device=dev)
        pred = model(img=objective.noisy(x0, noise, t), img_ids=img_pos, txt=txt, txt_ids=txt_pos, timesteps=t,
                     y=y, guidance=guidance if model.params.guidance_embed else None)
        loss = objective.loss(pred, objective.target(x0, noise, t))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.requires_grad_(False)
    model.eval()
    parts["transformer"] = model.to("cpu")
    return losses
