"""Train a Flux LoRA with FLAME.

    python examples/train_flux_lora.py                      # demo: a tiny Flux on a synthetic dataset, < 60 s on CPU
    python examples/train_flux_lora.py --config run.yaml    # an ai-toolkit-style config (see docs in the config module)
    python examples/train_flux_lora.py --model flux1-dev.safetensors --data latents/ --steps 2000 --rank 16

A real run needs a Flux checkpoint (BFL, diffusers or ComfyUI file) and a folder of precomputed samples: one
.safetensors per sample holding 'latents' (16, H/8, W/8), 'prompt_embeds' (L, 4096) and 'pooled_prompt_embeds' (768,)
(VAE and text encoders are not part of FLAME yet). Outputs go to <training_folder>/<name>/: the LoRA file, samples
(latent previews), the loss log (CSV/JSON) and its plot; checkpoints under checkpoints/, and running the same command
again resumes from the latest one. Every config problem and missing file is reported before training starts.
"""
import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flame_core as flame  # noqa: E402
from flame_core.errors import FlameError  # noqa: E402
from flame_models.training import Trainer, config_from_dict, load_config  # noqa: E402
from flame_models.training.config import ConfigError  # noqa: E402


def demo_config(device):
    """The no-argument run: tiny Flux, 32 synthetic samples of 4 kinds, LoRA r8 on every block Linear."""
    gpu = device.startswith("cuda")
    return {
        "name": "flux_lora_tiny", "training_folder": "runs", "device": device,
        "model": {"size": "flux-tiny", "dtype": "bf16" if gpu else "fp32"},
        "synthetic": {"num_samples": 32, "height": 64, "width": 64, "text_length": 8, "seed": 0},
        "network": {"type": "lora", "linear": 8, "linear_alpha": 8, "target": "all_linear"},
        "train": {"steps": 600, "batch_size": 4, "lr": 3e-3, "optimizer": "adamw", "lr_warmup_steps": 20,
                  "timestep_type": "sigmoid", "gradient_checkpointing": False,
                  "dtype": "bf16" if gpu else "fp32", "seed": 0},
        "sample": {"sample_every": 200, "sample_steps": 20, "guidance_scale": 1.0, "num_samples": 4},
        "save": {"save_every": 200, "format": "kohya", "dtype": "fp32", "max_step_saves_to_keep": 2},
        "log_every": 1,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="ai-toolkit-style YAML (job/config/process)")
    p.add_argument("--model", help="Flux checkpoint (.safetensors file or diffusers folder)")
    p.add_argument("--data", help="folder of per-sample .safetensors (latents, prompt_embeds, pooled_prompt_embeds)")
    p.add_argument("--name", help="run name (output folder and file names)")
    p.add_argument("--output", help="training folder (default runs)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--rank", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--network", choices=["lora", "dora", "lokr", "loha"])
    p.add_argument("--targets", help="preset (attention, attention_all, all_linear) or comma-separated patterns")
    p.add_argument("--format", choices=["kohya", "peft"], help="LoRA file layout")
    p.add_argument("--optimizer", choices=["adamw", "adamw8bit"])
    p.add_argument("--timestep-type", choices=["sigmoid", "logit_normal", "uniform", "shift", "flux_shift"])
    p.add_argument("--sample-every", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--gradient-checkpointing", choices=["on", "off"])
    p.add_argument("--fresh", action="store_true", help="ignore (delete) this run's checkpoints and start over")
    return p.parse_args(argv)


def build_config(a):
    device = a.device or ("cuda" if flame.cuda_is_available() else "cpu")
    demo = not (a.config or a.model or a.data)
    if a.config:
        import yaml
        from flame_models.training.config import load_config as _load
        cfg_dict = None
        base = _load(a.config, check_files=False)  # parse errors first, with the file's name
        with open(a.config) as f:
            cfg_dict = yaml.safe_load(f)
        proc = cfg_dict["config"]["process"][0] if "config" in cfg_dict else cfg_dict
        if "config" in cfg_dict and "name" in cfg_dict["config"]:
            proc.setdefault("name", cfg_dict["config"]["name"])
        del base
    elif demo:
        proc = demo_config(device)
    else:
        proc = {"name": "flux_lora", "device": device}
    if a.model:
        proc.setdefault("model", {})["name_or_path"] = a.model
    if a.data:
        proc["datasets"] = [{"folder_path": a.data}]
    sections = {"train": {"steps": a.steps, "batch_size": a.batch_size, "lr": a.lr, "optimizer": a.optimizer,
                          "timestep_type": a.timestep_type,
                          "gradient_checkpointing": None if a.gradient_checkpointing is None
                          else a.gradient_checkpointing == "on"},
                "network": {"linear": a.rank, "linear_alpha": a.alpha, "type": a.network,
                            "target": None if a.targets is None else (a.targets if "," not in a.targets
                                                                      else a.targets.split(","))},
                "save": {"format": a.format, "save_every": a.save_every},
                "sample": {"sample_every": a.sample_every}}
    for sec, vals in sections.items():
        for k, v in vals.items():
            if v is not None:
                proc.setdefault(sec, {})[k] = v
    for k, v in (("name", a.name), ("training_folder", a.output), ("device", a.device)):
        if v is not None:
            proc[k] = v
    proc.setdefault("device", device)
    return config_from_dict(proc, a.config or "command line"), demo


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    try:
        cfg, demo = build_config(a)
        if a.fresh or demo:
            shutil.rmtree(os.path.join(cfg.output_dir, "checkpoints"), ignore_errors=True)
            for f in ("loss.csv", "loss.json"):
                if os.path.exists(os.path.join(cfg.output_dir, f)):
                    os.remove(os.path.join(cfg.output_dir, f))
        trainer = Trainer(cfg).setup()   # loads and checks the model, data and sample embeddings
    except (ConfigError, FlameError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = trainer.train()
    losses = result["losses"]
    k = max(1, min(50, len(losses) // 10))
    print("\nwrote:")
    print(f"  LoRA       {result['lora']}  ({cfg.save.format} layout)")
    if "samples" in result:
        print(f"  samples    {result['samples']}  (latent previews: no VAE yet)")
    if "loss_plot" in result:
        print(f"  loss plot  {result['loss_plot']}")
    print(f"  loss log   {result['loss_csv']}, {result['loss_json']}")
    if len(losses) >= 2 * k:
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"loss: mean of the first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
              f"({first / last:.2f}x lower)")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
