"""Train a Flux LoRA with FLAME.

    python examples/train_flux_lora.py                      # the demo: a tiny Flux on synthetic data, < 60 s on CPU
    python examples/train_flux_lora.py --config run.yaml    # an ai-toolkit-style config (see examples/configs/)
    python examples/train_flux_lora.py --model flux1-dev.safetensors --data latents/ --steps 2000 --rank 16

A real run needs a Flux checkpoint (BFL, diffusers or ComfyUI file) and a folder of precomputed samples: one
.safetensors per sample holding 'latents' (16, H/8, W/8), 'prompt_embeds' (L, 4096) and 'pooled_prompt_embeds' (768,)
(image folders, the VAE and the text encoders are not part of the trainer yet). Outputs go to
<training_folder>/<name>/: the LoRA file, samples (latent previews), the loss log (CSV/JSON) and its plot, checkpoints
under checkpoints/. Every config problem and unusable file is reported before anything is loaded (exit code 2).
"""
import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flame_core as flame  # noqa: E402
from flame_core.errors import FlameError  # noqa: E402
from flame_models.training import Trainer, config_from_dict  # noqa: E402
from flame_models.training.config import (ConfigError, NetworkConfig, SaveConfig, TrainConfig,  # noqa: E402
                                          TrainSection, read_yaml)

EPILOG = """\
With no arguments the demo runs: a tiny Flux (random weights) learns 4 synthetic "concepts" on the CPU in well under
a minute, each demo in a fresh folder runs/flux_lora_tiny[-N] (earlier demos are kept).

Resume is automatic: running the same command again continues from the run's newest intact checkpoint (damaged
ones are skipped, saying why). Settings that can change mid-run (lr, optimizer_params, steps, schedule, sample /
save / log cadence, ...) apply from there on, with a warning; a change that cannot continue the run (rank, network
type, targets, model, data, batch size, seed) is an error. --fresh removes the run's checkpoints and outputs and
starts over; nothing is ever deleted without it (except checkpoints beyond save.max_step_saves_to_keep).

Ctrl-C (or SIGTERM) stops after the current step and writes a checkpoint, the LoRA, the loss log and plot (exit
130); press it twice to abort at once. Exit codes: 0 done, 2 bad input (nothing was trained), 130 interrupted."""

DEMO_STEPS = 600


def demo_config(device):
    """The no-argument run: tiny Flux, 32 synthetic samples of 4 kinds, LoRA r8 on every block Linear."""
    gpu = device.startswith("cuda")
    return {
        "name": "flux_lora_tiny", "training_folder": "runs", "device": device,
        "model": {"size": "flux-tiny", "dtype": "bf16" if gpu else "fp32"},
        "synthetic": {"num_samples": 32, "height": 64, "width": 64, "text_length": 8, "seed": 0},
        "network": {"type": "lora", "linear": 8, "linear_alpha": 8, "target": "all_linear"},
        "train": {"steps": DEMO_STEPS, "batch_size": 4, "lr": 3e-3, "optimizer": "adamw", "lr_warmup_steps": 20,
                  "timestep_type": "sigmoid", "gradient_checkpointing": False,
                  "dtype": "bf16" if gpu else "fp32", "seed": 0},
        "sample": {"sample_every": 200, "sample_steps": 20, "guidance_scale": 1.0, "num_samples": 4},
        "save": {"save_every": 200, "format": "kohya", "dtype": "fp32", "max_step_saves_to_keep": 2},
        "log_every": 1,
    }


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def parser():
    t, n, s = TrainSection(), NetworkConfig(), SaveConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                epilog=EPILOG, formatter_class=_Formatter)
    add = p.add_argument
    add("--config", metavar="YAML", help="ai-toolkit-style config (job/config/process); the flags below override "
                                         "it (default: none, the flags alone; no arguments at all: the demo)")
    add("--model", metavar="PATH", help="Flux checkpoint: .safetensors file or diffusers folder (default: a random "
                                        "flux-tiny)")
    add("--data", metavar="FOLDER", help="folder of per-sample .safetensors (latents, prompt_embeds, "
                                         "pooled_prompt_embeds) (default: none; the demo: synthetic samples)")
    add("--name", help=f"run name: output folder and file names (default {TrainConfig().name}; the demo: "
                       f"flux_lora_tiny[-N], a fresh one each time)")
    add("--output", metavar="FOLDER", help=f"training folder the run's folder goes into (default "
                                           f"{TrainConfig().training_folder})")
    add("--device", help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    add("--steps", type=int, help=f"optimizer steps (default {t.steps}; the demo {DEMO_STEPS}); a warm-up longer "
                                  f"than the run is shortened, with a note")
    add("--batch-size", type=int, help=f"samples per micro-batch (default {t.batch_size}; the demo 4)")
    add("--lr", type=float, help=f"learning rate (default {t.lr:g}; the demo 3e-3)")
    add("--rank", type=int, help=f"adapter rank (default {n.linear}; the demo 8)")
    add("--alpha", type=float, help=f"adapter alpha; scale = alpha / rank (default {n.linear_alpha:g})")
    add("--network", choices=["lora", "dora", "lokr", "loha"], help=f"adapter type (default {n.type})")
    add("--targets", help="preset (attention, attention_all, all_linear) or comma-separated name patterns "
                          "(default attention; the demo all_linear)")
    add("--format", choices=["kohya", "peft"], help=f"LoRA file layout (default {s.format})")
    add("--optimizer", choices=["adamw", "adamw8bit"], help=f"optimizer (default {t.optimizer}; the demo adamw)")
    add("--timestep-type", choices=["sigmoid", "logit_normal", "uniform", "shift", "flux_shift"],
        help=f"how training timesteps are drawn (default {t.timestep_type})")
    add("--sample-every", type=int, metavar="N", help="sample the prompts every N steps, 0 never (default 250; the "
                                                      "demo 200)")
    add("--save-every", type=int, metavar="N", help=f"checkpoint every N steps (default {s.save_every}; the demo "
                                                    f"200)")
    add("--gradient-checkpointing", choices=["on", "off"], help="recompute activations in backward (default on; "
                                                                "the demo off)")
    add("--fresh", action="store_true", help="remove this run's checkpoints and outputs and start over (default: "
                                             "resume from the newest intact checkpoint)")
    return p


def _fresh_demo_name(folder, name):
    """name, or name-2, name-3, ...: the first with no folder yet (a demo never reuses or deletes another's)."""
    k, cand = 1, name
    while os.path.exists(os.path.join(folder, cand)):
        k += 1
        cand = f"{name}-{k}"
    return cand


def build_config(a):
    """(TrainConfig, demo?, notes) from the parsed flags."""
    device = a.device or ("cuda" if flame.cuda_is_available() else "cpu")
    demo = not (a.config or a.model or a.data)
    notes = []
    if a.config:
        data = read_yaml(a.config)
        if not isinstance(data, dict):
            raise ConfigError(f"{a.config}: the top level must be a mapping")
        proc = data["config"]["process"][0] if isinstance(data.get("config"), dict) and \
            isinstance(data["config"].get("process"), list) and data["config"]["process"] and \
            isinstance(data["config"]["process"][0], dict) else data
    else:
        data = proc = demo_config(device) if demo else {"name": TrainConfig().name, "device": device}
    if a.model:
        proc.setdefault("model", {})["name_or_path"] = a.model
    if a.data:
        proc["datasets"] = [{"folder_path": a.data}]
        proc.pop("synthetic", None)
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
                if not isinstance(proc.get(sec), dict):
                    proc[sec] = {}
                proc[sec][k] = v
    for k, v in (("name", a.name), ("training_folder", a.output), ("device", a.device)):
        if v is not None:
            proc[k] = v
    proc.setdefault("device", device)
    train = proc.get("train") if isinstance(proc.get("train"), dict) else {}
    if a.steps is not None and isinstance(train.get("lr_warmup_steps"), int) and train["lr_warmup_steps"] >= a.steps:
        clipped = a.steps // 4
        notes.append(f"--steps {a.steps}: the {train['lr_warmup_steps']} warm-up steps are shortened to {clipped}")
        train["lr_warmup_steps"] = clipped
    if demo and a.name is None:
        proc["name"] = _fresh_demo_name(proc.get("training_folder", "runs"), proc["name"])
    return config_from_dict(data, a.config or "command line"), demo, notes


def resume_command(argv, cfg, demo):
    cmd = [sys.executable, sys.argv[0] if sys.argv and sys.argv[0] else "examples/train_flux_lora.py"] + list(argv)
    if demo and "--name" not in argv:
        cmd += ["--name", cfg.name]
    return shlex.join(cmd)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        cfg, demo, notes = build_config(a)
        for note in notes:
            print(f"note: {note}")
        if demo:
            print(f"demo: a tiny Flux on synthetic data, writing to {cfg.output_dir} (a fresh folder)")
        trainer = Trainer(cfg, fresh=a.fresh).setup()  # checks everything, then builds the model and resumes
    except (ConfigError, FlameError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = trainer.train()
    except KeyboardInterrupt:
        print(f"aborted: the steps since the last checkpoint are lost; run `{resume_command(argv, cfg, demo)}` to "
              f"resume from it", file=sys.stderr)
        return 130
    losses = result["losses"]
    print("\nwrote:")
    print(f"  LoRA       {result['lora']}  ({cfg.save.format} layout)")
    if "samples" in result:
        print(f"  samples    {result['samples']}  (latent previews: no VAE yet)")
    if "loss_plot" in result:
        print(f"  loss plot  {result['loss_plot']}")
    print(f"  loss log   {result['loss_csv']}, {result['loss_json']}")
    if result["interrupted"]:
        print(f"stopped at step {result['steps']} of {cfg.train.steps} ({result['interrupted']}); to resume, run: "
              f"{resume_command(argv, cfg, demo)}")
        return 130
    k = max(1, min(50, len(losses) // 10))
    if len(losses) >= 2 * k:
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"loss: mean of the first {k} rows {first:.3f} -> last {k} rows {last:.3f} ({first / last:.2f}x lower)")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
