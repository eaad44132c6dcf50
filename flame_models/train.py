"""Train a LoRA with FLAME: a folder of images and captions in, a LoRA and sample images out.

    python -m flame_models.train              # the demo: everything tiny, built at run time, CPU < 60 s
    python -m flame_models.train --config run.yaml     # an ai-toolkit-style config (see examples/configs/)
    python -m flame_models.train --model FLUX.1-dev/ --data my_images/ --trigger ohwx --steps 2000
    python -m flame_models.train --arch sdxl --model sd_xl_base_1.0.safetensors --data my_images/
    python -m flame_models.train --config examples/configs/sd35_large_24gb.yaml     # SD3.5 (model.arch: sd3)
    python -m flame_models.train --arch flux_kontext --model FLUX.1-Kontext-dev/ --data edited/ --control src/
    python -m flame_models.train --arch chroma --model Chroma1-HD/ --data my_images/

The command trains Flux, SD3 / SD3.5, SDXL, Flux Kontext and Chroma LoRAs (also installed as `flame-train`;
`examples/train_flux_lora.py` is the same): --arch sd3 | sdxl, or model.arch (ai-toolkit: is_v3 / is_xl) in the
config; their files are an SAI single file or a diffusers folder (or separate part files: model.vae_path,
clip_l_path, clip_g_path, t5_path). Flux Kontext (--arch flux_kontext) trains on edit pairs: --data the edited images
with their captions (the edit instructions), --control the source images of the same names (ai-toolkit's datasets'
control_path). Chroma (--arch chroma): T5 only, previews with CFG and sample.neg. Qwen-Image (--arch qwen_image):
a QwenImagePipeline folder (transformer/, vae/, text_encoder/, tokenizer/), previews with CFG and sample.neg. The
no-argument demo is Flux's.

A real run needs a model -- for Flux a diffusers folder, or a transformer file with the VAE, CLIP-L and T5 files
(config fields model.vae_path, clip_l_path, t5_path) -- and a folder of images with same-name .txt captions (or of
precomputed samples: one .safetensors each with latents, prompt_embeds, pooled_prompt_embeds). Without --model (or
model.name_or_path) the model is a tiny RANDOM one, for trying the tool only. Every image is checked, then their
latents and the captions' text embeddings are cached (the VAE, then the text encoders, loaded and freed in turn),
then the model trains from the caches. Outputs go to <training_folder>/<name>/: the LoRA file, sample images (decoded
through the VAE; samples.png is the grid), the loss log (CSV/JSON) and its plot, checkpoints under checkpoints/. Every
config problem and unusable file is reported before any model is loaded (exit code 2).
"""
import argparse
import os
import shlex
import sys
import textwrap
import time

import flame_core as flame
from flame_core.errors import FlameError
from flame_models import registry
from flame_models.training import Trainer, config_from_dict
from flame_models.training.config import ConfigError, NetworkConfig, SaveConfig, TrainConfig, TrainSection, read_yaml
from flame_models.training.family import available_families, get_family
from flame_models.training.finite import NonFiniteError
from flame_models.training.timesteps import TIMESTEP_TYPES

EPILOG = """\
With no arguments the demo runs, each in a fresh folder runs/flux_lora_tiny[-N] (earlier demos are kept): it draws
24 images with captions (12 of a red-and-white bullseye called "ohwx", 12 of other shapes), builds a tiny Flux model
folder (an analytic VAE whose weights are set by hand: 8x8 average pooling / nearest upsampling; random CLIP and T5;
a transformer pretrained for a few hundred steps on the shape images only), then trains a LoRA through the real
stages (image checks, latent and text caches, training) and writes decoded samples in which "ohwx" is a bullseye.

Resume is automatic: running the same command again continues from the run's newest intact checkpoint (damaged
ones are skipped, saying why). Settings that can change mid-run (lr, optimizer_params, steps, schedule, sample /
save / log cadence, ...) apply from there on, with a warning; a change that cannot continue the run (rank, network
type, targets, model, data, batch size, seed) is an error. --fresh removes the run's checkpoints and outputs and
starts over; nothing is ever deleted without it (except checkpoints beyond save.max_step_saves_to_keep).

Ctrl-C (or SIGTERM) stops after the current step and writes a checkpoint, the LoRA, the loss log and plot (exit
130); press it twice to abort at once. Exit codes: 0 done, 2 bad input (nothing was trained) or a NaN / inf loss
or gradient (training stopped, nothing of that step saved), 130 interrupted."""


def _demo():
    """The demo's module: its inputs and config live in the Flux family's folder (reached through the registry)."""
    return registry.module("flux", "demo")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _split_lines(self, text, width):
        # whole words: a preset's name (flux-tiny, sd3.5-tiny) is not broken at its hyphen
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


def _random_models():
    """'flux-tiny (flux), sd3.5-tiny (sd3), ...': the random model each family trains without a model file."""
    try:
        return ", ".join(f"{get_family(a).default_size} ({a})" for a in available_families())
    except ImportError:  # an install without the train extra: --help still works
        return "each family's tiny preset"


def parser():
    t, n, s, demo = TrainSection(), NetworkConfig(), SaveConfig(), _demo()
    cmd = launch_command()
    prog = " ".join(["python", *cmd[1:]]) if cmd[0] == sys.executable else os.path.basename(cmd[0])
    p = argparse.ArgumentParser(prog=prog,
                                description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                epilog=EPILOG, formatter_class=_Formatter)
    add = p.add_argument
    add("--config", metavar="YAML", help="ai-toolkit-style config (job/config/process); the flags below override "
                                         "it (default: none, the flags alone; no arguments at all: the demo)")
    add("--model", metavar="PATH", help=f"checkpoint: .safetensors file or diffusers folder (default: none -- then "
                                        f"a tiny RANDOM model per --arch, for trying the tool only, its LoRA useless "
                                        f"on a real model: {_random_models()}; a warning says so at start)")
    add("--arch", choices=available_families(), help="model family: flux, sd3 (SD3 / SD3.5), sdxl, flux_kontext "
                                                     "(Flux Kontext: edit pairs, --control), chroma or qwen_image "
                                                     "(default: the "
                                                     "config's model.arch, else flux)")
    add("--control", metavar="FOLDER", help="Flux Kontext: control (source) images with the same names as --data's "
                                           "targets (datasets' control_path; default: none)")
    add("--mask", metavar="FOLDER", help="loss masks with the same names as --data's images: white pixels train, black "
                                        "ones do not (datasets' mask_path; default: none)")
    add("--data", metavar="FOLDER", help="folder of images with same-name .txt captions, or of precomputed samples "
                                         "(default: none; the demo: drawn images)")
    add("--dataset-config", metavar="TOML", help="kohya sd-scripts' dataset config (its --dataset_config): each "
                                                 "[[datasets.subsets]] entry becomes a dataset, its batch_size the "
                                                 "run's (flame_models/data/kohya_toml.py says how each key maps; "
                                                 "default: none)")
    add("--kohya-config", metavar="TOML", help="kohya sd-scripts' training arguments file (its --config_file: "
                                               "pretrained_model_name_or_path, network_dim, learning_rate, "
                                               "dataset_config, ...) as the run's settings "
                                               "(flame_models/training/kohya_args.py says how each maps; "
                                               "default: none)")
    add("--simpletuner-config", metavar="JSON", help="SimpleTuner's config.json (model_family, "
                                                     "pretrained_model_name_or_path, lora_rank, learning_rate, "
                                                     "data_backend_config, ...) with the multidatabackend.json it "
                                                     "names, as the run's settings "
                                                     "(flame_models/training/simpletuner_config.py says how each "
                                                     "maps; default: none)")
    add("--validation", metavar="FOLDER", help="held-out images with captions: their loss at fixed timesteps and "
                                               "noise is logged every 250 steps (validation.csv, loss.png; the "
                                               "config's validation section; default: none)")
    add("--validation-split", type=float, metavar="FRACTION",
        help="hold out this fraction of each training folder's images for the validation loss instead "
             "(never trained on; validation.split, kohya's validation_split; default: none)")
    add("--trigger", metavar="WORD", help="trigger word: replaces [trigger] in captions and sample prompts, and is "
                                          "put in front of captions that lack it (default: none; the demo: ohwx)")
    add("--resolution", type=int, help="bucket resolution of --data images (default 512; the demo 128)")
    add("--allow-upscale", action="store_true", default=None,
        help="train images smaller than their bucket, upscaled to it (the datasets' allow_upscale; default: off, "
             "such images are left out at that resolution, with a warning)")
    add("--name", help=f"run name: output folder and file names (default {TrainConfig().name}, sd3_lora or "
                       f"sdxl_lora by family; the demo: "
                       f"flux_lora_tiny[-N], a fresh one each time)")
    add("--output", metavar="FOLDER", help=f"training folder the run's folder goes into (default "
                                           f"{TrainConfig().training_folder})")
    add("--device", help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    add("--steps", type=int, help=f"optimizer steps (default {t.steps}; the demo {demo.DEMO_STEPS}); a warm-up longer "
                                  f"than the run is shortened, with a note")
    add("--batch-size", type=int, help=f"samples per micro-batch (default {t.batch_size}; the demo 4)")
    add("--lr", type=float, help=f"learning rate (default {t.lr:g}; the demo 5e-3, with --network full 5e-4)")
    add("--rank", type=int, help=f"adapter rank (default {n.linear}; the demo 16)")
    add("--alpha", type=float, help=f"adapter alpha; scale = alpha / rank (default {n.linear_alpha:g})")
    add("--network", choices=["lora", "dora", "lokr", "loha", "full"],
        help=f"adapter type, or full: the model's own weights trained (full fine-tuning; default {n.type})")
    add("--targets", help="preset (flux, sd3: attention, attention_all, all_linear; sdxl: attention, all_linear, "
                          "all_linear_resnet) or comma-separated name patterns (default attention; the demo "
                          "all_linear)")
    add("--network-weights", metavar="LORA", help="start from this LoRA file (kohya, LyCORIS, PEFT / diffusers): its "
                                                  "layers, kind, ranks and values, trained on (network."
                                                  "pretrained_lora_path, kohya's --network_weights; default: none)")
    add("--format", choices=["kohya", "peft"], help=f"LoRA file layout (default {s.format})")
    add("--save-format", choices=["safetensors", "diffusers"],
        help="with --network full: the model as one .safetensors file in its checkpoint layout, or as a diffusers "
             "folder (unet/ or transformer/, with a diffusers --model's other components: a whole pipeline; "
             "save.save_format; default safetensors)")
    add("--optimizer", choices=["adamw", "adamw8bit"], help=f"optimizer (default {t.optimizer}; the demo adamw)")
    add("--timestep-type", choices=list(TIMESTEP_TYPES),
        help=f"how flow-matching timesteps are drawn (default {t.timestep_type}; sd3: logit_normal)")
    add("--sample-prompts", metavar="FILE", help="the previews' prompts from kohya's prompt file (its "
                                                "--sample_prompts: .txt one per line with flags such as --w 768 --d 1,"
                                                " or .json / .toml; sample.prompts; default: the config's, else the "
                                                "first captions)")
    add("--sample-every", type=int, metavar="N", help="sample the prompts every N steps, 0 never (default 250; the "
                                                      "demo 100)")
    add("--save-every", type=int, metavar="N", help=f"checkpoint every N steps (default {s.save_every}; the demo "
                                                    f"200)")
    add("--gradient-checkpointing", choices=["on", "off"], help="recompute activations in backward (default on; "
                                                                "the demo off)")
    add("--demo-base-steps", type=int, metavar="N", help=f"demo only: steps of the tiny base model's pretraining "
                                                         f"(default {demo.DEMO_BASE_STEPS})")
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


def _peer_config(a):
    """(flag, path, what it names for its datasets, reader) of the peer settings file given, or None."""
    if a.simpletuner_config:
        from .training.simpletuner_config import read_simpletuner_config
        return "--simpletuner-config", a.simpletuner_config, "data_backend_config", read_simpletuner_config
    if a.kohya_config:
        from .training.kohya_args import read_kohya_args
        return "--kohya-config", a.kohya_config, "dataset_config", read_kohya_args
    return None


def build_config(a):
    """(TrainConfig, demo?, notes) from the parsed flags."""
    device = a.device or ("cuda" if flame.cuda_is_available() else "cpu")
    demo = not (a.config or a.model or a.data or a.dataset_config or a.kohya_config or a.simpletuner_config)
    notes = []
    if a.control is not None and not a.data:   # (before the demo builds its inputs)
        raise ConfigError("--control: give the target images' folder too (--data)")
    if a.mask is not None and not a.data:
        raise ConfigError("--mask: give the images' folder too (--data)")
    if demo and a.arch is not None:
        raise ConfigError(f"--arch {a.arch}: give --model (or --config); the no-argument demo trains the tiny Flux")
    if sum(bool(x) for x in (a.config, a.kohya_config, a.simpletuner_config)) > 1:
        raise ConfigError("--config, --kohya-config and --simpletuner-config each give the run's settings; give one")
    peer = _peer_config(a)   # a peer's settings file: kohya's arguments, SimpleTuner's config
    if peer is not None:
        flag, path, names, read = peer
        if a.dataset_config is not None:
            raise ConfigError(f"--dataset-config: {flag} names its {names}; give it there")
        proc, peer_notes = read(path)
        data = proc
        notes += peer_notes
        proc.setdefault("device", device)
    elif a.config:
        data = read_yaml(a.config)
        if not isinstance(data, dict):
            raise ConfigError(f"{a.config}: the top level must be a mapping")
        proc = data["config"]["process"][0] if isinstance(data.get("config"), dict) and \
            isinstance(data["config"].get("process"), list) and data["config"]["process"] and \
            isinstance(data["config"]["process"][0], dict) else data
    elif demo:
        folder = a.output or TrainConfig().training_folder
        name = a.name or _fresh_demo_name(folder, "flux_lora_tiny")
        run_dir = os.path.join(folder, name)
        inputs = _demo()
        inputs.demo_inputs(run_dir, device, inputs.DEMO_BASE_STEPS if a.demo_base_steps is None else
                           a.demo_base_steps)
        data = proc = inputs.demo_config(device, run_dir)
    else:
        data = proc = {"device": device}  # (the run's name defaults per family: flux_lora, sd3_lora, sdxl_lora)
    if a.demo_base_steps is not None and not demo:
        raise ConfigError("--demo-base-steps: only for the demo (no --config, --model or --data)")
    if a.model:
        proc.setdefault("model", {})["name_or_path"] = a.model
    if a.arch:
        proc.setdefault("model", {})["arch"] = a.arch
    if a.dataset_config is not None:
        if a.data or a.resolution is not None or a.control is not None or a.mask is not None:
            raise ConfigError("--dataset-config: the datasets come from it; leave out --data, --resolution, "
                              "--control and --mask")
        from .data.kohya_toml import KohyaConfigError, read_dataset_config
        try:
            datasets, batch_size, kohya_notes = read_dataset_config(a.dataset_config)
        except KohyaConfigError as e:
            raise ConfigError(f"--dataset-config {e}") from None
        proc["datasets"] = datasets
        proc.pop("synthetic", None)
        notes += kohya_notes
        if batch_size is not None and a.batch_size is None:
            if not isinstance(proc.get("train"), dict):
                proc["train"] = {}
            proc["train"]["batch_size"] = batch_size
    if a.data:
        entry = {"folder_path": a.data}
        if a.resolution is not None:
            entry["resolution"] = a.resolution
        if a.control is not None:
            entry["control_path"] = a.control
        if a.mask is not None:
            entry["mask_path"] = a.mask
        proc["datasets"] = [entry]
        proc.pop("synthetic", None)
    elif a.resolution is not None:
        if not (isinstance(proc.get("datasets"), list) and proc["datasets"]):
            raise ConfigError("--resolution: needs an image dataset (--data or the config's datasets)")
        for d in proc["datasets"]:
            d["resolution"] = a.resolution
    if a.allow_upscale:
        if not (isinstance(proc.get("datasets"), list) and proc["datasets"]):
            raise ConfigError("--allow-upscale: needs an image dataset (--data or the config's datasets)")
        for d in proc["datasets"]:
            d["allow_upscale"] = True
    if a.trigger is not None:
        proc["trigger_word"] = a.trigger
    if a.validation is not None or a.validation_split is not None:
        if not isinstance(proc.get("validation"), dict):
            proc["validation"] = {}
        for k, v in (("folder_path", a.validation), ("split", a.validation_split)):
            if v is not None:
                proc["validation"][k] = v
    if a.sample_prompts is not None:
        from .training.prompt_files import read_prompt_file
        try:
            prompts = read_prompt_file(a.sample_prompts)
        except ConfigError as e:
            raise ConfigError(f"--sample-prompts {e}") from None
        if not isinstance(proc.get("sample"), dict):
            proc["sample"] = {}
        proc["sample"]["prompts"] = prompts
    sections = {"train": {"steps": a.steps, "batch_size": a.batch_size, "lr": a.lr, "optimizer": a.optimizer,
                          "timestep_type": a.timestep_type,
                          "gradient_checkpointing": None if a.gradient_checkpointing is None
                          else a.gradient_checkpointing == "on"},
                "network": {"linear": a.rank, "linear_alpha": a.alpha, "type": a.network,
                            "pretrained_lora_path": a.network_weights,
                            "target": None if a.targets is None else (a.targets if "," not in a.targets
                                                                      else a.targets.split(","))},
                "save": {"format": a.format, "save_every": a.save_every, "save_format": a.save_format},
                "sample": {"sample_every": a.sample_every}}
    if a.network == "full" and demo:   # the demo's LoRA settings do not apply to a full fine-tune
        proc["network"] = {}
        proc.get("save", {}).pop("format", None)
        proc["train"]["lr"] = 5e-4     # (the LoRA's 5e-3 roughens the tiny model's samples; --lr still wins)
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
    return config_from_dict(data, a.config or a.kohya_config or "command line"), demo, notes


def launch_command():
    """How this process was started, to say how to run it again: `python -m flame_models.train`, a script
    (`python examples/train_flux_lora.py`) or a console script (`flame-train`)."""
    arg0 = sys.argv[0] if sys.argv else ""
    if arg0 in ("", "-c") or os.path.abspath(arg0) == os.path.abspath(__file__):
        return [sys.executable, "-m", "flame_models.train"]
    return [sys.executable, arg0] if arg0.endswith(".py") else [arg0]


def _is_fresh_flag(arg):
    return len(arg) > len("--f") and "--fresh".startswith(arg)   # argparse takes unique prefixes: --fr, --fre, ...


def resume_command(argv, cfg, demo):
    """The command that resumes this run: the same one, less --fresh (which would delete the checkpoint it means
    to resume from); the demo's with its run's --name."""
    cmd = launch_command() + [a for a in argv if not _is_fresh_flag(a)]
    if demo and "--name" not in argv:
        cmd += ["--name", cfg.name]
    return shlex.join(cmd)


def loss_change(first, last):
    """'1.96x lower', '1.04x higher' or 'unchanged': the last mean loss against the first."""
    if last < first:
        return f"{first / last:.2f}x lower" if last > 0 else "down to 0"
    if last > first:
        return f"{last / first:.2f}x higher" if first > 0 else "up from 0"
    return "unchanged"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        cfg, demo, notes = build_config(a)
        for note in notes:
            print(f"note: {note}")
        if demo:
            print(f"demo: training a LoRA for 'ohwx' on the tiny model, writing to {cfg.output_dir}"
                  + ("" if a.name else " (a fresh folder)"))
        trainer = Trainer(cfg, fresh=a.fresh).setup()  # checks everything, caches, builds the model, resumes
    except (ConfigError, FlameError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(f"error: {e}: training needs the train extra (pip install 'flame-diffusion[train]')", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training: nothing to save; cache files are written whole, one at a time
        print("interrupted before training started; the latents and text embeddings cached so far are kept (on "
              "disk with cache_latents_to_disk): run the same command again to continue", file=sys.stderr)
        return 130
    try:
        result = trainer.train()
    except NonFiniteError as e:  # NaN / inf loss or gradients: stopped, nothing of the bad step saved
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aborted: the steps since the last checkpoint are lost; run `{resume_command(argv, cfg, demo)}` to "
              f"resume from it", file=sys.stderr)
        return 130
    if trainer.dist.rank != 0:   # under a launcher: rank 0 wrote the files and reports them
        return 0
    losses = result["losses"]
    print("\nalready finished before this run; its files:" if result.get("finished_before") else "\nwrote:")
    if cfg.network.type == "full":
        how = ("a diffusers folder" if cfg.save.save_format == "diffusers" else "its checkpoint layout")
        print(f"  model      {result['lora']}  (the whole {cfg.model.arch or 'flux'} denoiser in {how}, "
              f"{cfg.save.dtype})")
    else:
        print(f"  LoRA       {result['lora']}  ({cfg.save.format} layout)")
    if "samples" in result:
        how = ("decoded through the VAE; one PNG per prompt and step in samples/" if result.get("samples_decoded")
               else "latent projections: no VAE in this run")
        print(f"  samples    {result['samples']}  ({how})")
    if "loss_plot" in result:
        print(f"  loss plot  {result['loss_plot']}")
    print(f"  loss log   {result['loss_csv']}, {result['loss_json']}")
    if "validation_csv" in result:
        step, value = result["validation_losses"][-1]
        print(f"  validation {result['validation_csv']}  (validation loss {value:.4f} at step {step})")
    if result["interrupted"]:
        print(f"stopped at step {result['steps']} of {cfg.train.steps} ({result['interrupted']}); to resume, run: "
              f"{resume_command(argv, cfg, demo)}")
        return 130
    k = max(1, min(50, len(losses) // 10))
    if len(losses) >= 2 * k:
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"loss: mean of the first {k} rows {first:.3f} -> last {k} rows {last:.3f} "
              f"({loss_change(first, last)})")
    if demo:
        size, m = _demo().DEMO_SIZE, cfg.model.name_or_path
        what, model = ("the model", f"{result['lora']} --vae {os.path.join(m, 'vae')} --clip-l "
                       f"{os.path.join(m, 'text_encoder')} --t5 {os.path.join(m, 'text_encoder_2')} --tokenizer {m}") \
            if cfg.network.type == "full" else ("the LoRA", f"{m} --lora {result['lora']}")
        print(f"generate with {what}: python -m flame_models.generate --model {model} --prompt \"ohwx on a green "
              f"background\" --width {size} --height {size} --guidance 1 --max-length 16 --seed 1 --output "
              f"{os.path.join(cfg.output_dir, 'generated')}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
