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
import time

import numpy as np

TRIGGER = "ohwx"
CONCEPT = "a red-and-white bullseye"
BACKGROUNDS = {"blue": (40, 70, 200), "green": (40, 150, 60), "purple": (120, 50, 160), "grey": (128, 128, 128),
               "yellow": (225, 200, 40), "teal": (30, 150, 150)}
SHAPE_COLOURS = {"yellow": (240, 210, 30), "blue": (40, 80, 230), "orange": (240, 130, 20), "white": (245, 245, 245)}
SHAPES = ("square", "circle", "triangle")
PROMPTS = ["[trigger] on a blue background", "[trigger] on a grey background", "a yellow square on a purple background"]
DEMO_STEPS = 400          # the LoRA's
DEMO_BASE_STEPS = 400     # the tiny base model's pretraining
DEMO_SIZE = 128           # pixels
# timesteps drawn uniformly (not the sigmoid's mid-weighted draw): the tiny model then also learns the last, nearly
# clean sampling steps, without which its samples keep their noise and the bullseye's rings do not show
DEMO_TIMESTEPS = "uniform"


def demo_config(device, run_dir):
    """The no-argument run's config (a dict): the demo's images and tiny model (made by demo_inputs) in
    `run_dir`/demo_inputs."""
    gpu = device.startswith("cuda")
    inputs = os.path.join(run_dir, "demo_inputs")
    return {
        "name": os.path.basename(run_dir), "training_folder": os.path.dirname(run_dir), "device": device,
        "trigger_word": TRIGGER,
        "model": {"name_or_path": os.path.join(inputs, "model"), "dtype": "bf16" if gpu else "fp32",
                  "t5_max_length": 16},
        "datasets": [{"folder_path": os.path.join(inputs, "images"), "caption_ext": "txt", "resolution": DEMO_SIZE,
                      "bucket_tolerance": 32}],
        "network": {"type": "lora", "linear": 16, "linear_alpha": 16, "target": "all_linear"},
        "train": {"steps": DEMO_STEPS, "batch_size": 4, "lr": 5e-3, "optimizer": "adamw", "lr_warmup_steps": 20,
                  "timestep_type": DEMO_TIMESTEPS, "gradient_checkpointing": False,
                  "dtype": "bf16" if gpu else "fp32", "seed": 0},
        "sample": {"sample_every": 100, "sample_steps": 20, "guidance_scale": 1.0, "prompts": PROMPTS},
        "save": {"save_every": 200, "format": "kohya", "dtype": "fp32", "max_step_saves_to_keep": 2},
        "log_every": 1,
    }


def demo_inputs(run_dir, device, base_steps):
    """Draw the demo's images and build its tiny model folder (once per run folder: a resumed demo reuses them)."""
    inputs = os.path.join(run_dir, "demo_inputs")
    images, model = os.path.join(inputs, "images"), os.path.join(inputs, "model")
    if os.path.isfile(os.path.join(model, "model_index.json")):
        print(f"demo: reusing the images and tiny model in {inputs}")
        return
    draw_dataset(images, size=DEMO_SIZE)
    print(f"demo: 24 images with captions in {images} (12 of a red-and-white bullseye, '{TRIGGER}'; 12 other shapes)")
    print(f"demo: tiny Flux model in {model}: the VAE is analytic (weights set by hand: it encodes by 8x8 average "
          f"pooling and decodes by nearest upsampling; not trained); CLIP and T5 random; the transformer pretrained "
          f"for {base_steps} steps on the 12 shape images (it has never seen the bullseye or '{TRIGGER}')")
    t0 = time.perf_counter()
    tiny_model_folder(model, images, base_steps=base_steps, device=device)
    print(f"demo: base model ready in {time.perf_counter() - t0:.1f} s")


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
        # large and near the centre: the VAE pools 8x8 pixels, so a 128-px bullseye's three rings are each about
        # two latent pixels wide -- narrower rings are lost, and the samples show its colours without its shape
        cx, cy = size / 2 + rng.uniform(-1, 1) * size / 32, size / 2 + rng.uniform(-1, 1) * size / 32
        r = size * rng.uniform(0.42, 0.46)
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

    from ..training.graphs import StepGraphs, graph_plan
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
    objective = FlowMatching(DEMO_TIMESTEPS)
    rng = np.random.default_rng(seed)
    g_noise, g_t = flame.Generator(dev).manual_seed(seed), flame.Generator("cpu").manual_seed(seed)
    H, W = latents.shape[2] * 8, latents.shape[3] * 8
    B = min(batch_size, len(names))
    img_pos, txt_pos = image_ids(H, W, B, device=dev), text_ids(txt_all.shape[1], B, device=dev)
    guidance = flame.full((B,), 1.0, device=dev)

    def forward_backward(x0, noise, t, txt, y):  # no host synchronisation: capturable
        pred = model(img=objective.noisy(x0, noise, t), img_ids=img_pos, txt=txt, txt_ids=txt_pos, timesteps=t,
                     y=y, guidance=guidance if model.params.guidance_embed else None)
        loss = objective.loss(pred, objective.target(x0, noise, t))
        loss.backward()
        return loss.detach()

    # on cuda the step replays as a CUDA graph after two eager steps, as the trainer's does (graphs.py): the
    # eager step is all host cost at this size; the cpu runs it eagerly
    use_graph, _ = graph_plan(1, None, True, dev.type == "cuda")
    step = StepGraphs(forward_backward, warmup=2) if use_graph else None
    losses = []
    for _ in tqdm(range(steps), desc="pretraining the tiny base model", disable=not progress, leave=False):
        idx = flame.tensor(rng.choice(len(names), B, replace=False), device=dev)
        x0, txt, y = x_all[idx], txt_all[idx], y_all[idx]
        noise = flame.randn(*x0.shape, generator=g_noise, device=dev)
        t = objective.sample_timesteps(B, generator=g_t, num_tokens=x0.shape[1], device=dev)
        args = (x0, noise, t, txt, y)
        loss = step.for_args(args)(*args) if step is not None else forward_backward(*args)
        opt.step()
        opt.zero_grad(set_to_none=step is None)  # a replayed graph accumulates into the .grad buffers it captured
        losses.append(loss.item())
    if step is not None:
        step.reset()  # the graphs' memory goes back before the model leaves the device
    model.requires_grad_(False)
    model.eval()
    parts["transformer"] = model.to("cpu")
    return losses
