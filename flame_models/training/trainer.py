"""The training loop: adapters on a frozen diffusion model, and everything a long run needs. It knows no
architecture: the model family (family.py, `get_family(cfg.model.arch)`) supplies loading, the batch's inputs, the
objective, the forward, the preview sampler and the LoRA names.

    trainer = Trainer(cfg)          # a validated TrainConfig (config.load_config / config_from_dict)
    result = trainer.train()        # {"lora": path, "samples": path, "loss_plot": path, "stages": [...], ...}

Set-up runs in stages, each timed and its peak memory recorded (stages.py; result["stages"]): check (every image
and caption, or every sample file's header, before any model), latents and text (image folders and text prompts:
the VAE, then the text encoders, loaded, run into their caches and freed; image_data.py), build (the transformer
and its adapters); then train (samples inside it also count as their own stage). Image folders train from the
caches in batches of one aspect bucket (flame_models.data.BucketLoader, whose position is part of a checkpoint).

One optimizer step = `gradient_accumulation_steps` micro-batches: the family turns the batch into clean latents x0
and conditioning, timesteps and noise are drawn, the objective makes x_t and the target, the family's forward
predicts, the loss (float32) is backpropagated -- under autocast on the GPU and, there, replayed as a CUDA graph
after two eager steps (one graph per batch shape; graphs.py says when a run stays eager). Then gradient clipping,
the optimizer, the LR schedule, EMA. Every `save_every` steps a checkpoint (adapter, optimizer, scheduler, RNG
states, step, data position, EMA, training time, config) is written whole or not at all (checkpoint.py), and a
restart with the same config resumes from the newest intact one exactly:
the next step's loss and parameters equal those of a run that never stopped. A changed config either applies from
there on or is refused, and the checkpoint is chosen and loaded (resume.py). Every `sample_every` steps the
preview sampler runs while the progress clock is paused, and every `validation.every` steps the validation loss is
computed (validation_loss.py: held-out images at fixed timesteps and noise; its own log, drawn in the loss plot).
Ctrl-C / SIGTERM stop after the current step with a checkpoint (interrupt.py). A run whose checkpoint has
reached train.steps and whose final LoRA is written says so and keeps its files: its model is built and
restored, nothing is cached, encoded or trained.

The trainer owns its stages: each (image_data.prepare, resume.choose_checkpoint / restore, ...) is given what it
needs and returns what it made, and the trainer keeps it. Streaming (streaming.py), CUDA graphs (graphs.py) and data
parallelism (distributed.py) are parts the step calls at named points, not branches through it.
"""
import gc
import inspect
import json
import math
import os
from contextlib import nullcontext

import numpy as np

import flame_core as flame
import flame_nn
from flame_core import grad_pool, io
from flame_core.amp import autocast
from flame_core.autograd import no_grad
from flame_core.io import write_json
from flame_core.memory.stats import fmt_bytes, parse_budget
from flame_nn import adapters as A
from flame_nn.adapters.max_norm import MaxNorm

from .. import checkpoint_io as CIO
from ..data import ConcatDataset, FolderDataset, SampleLoader, SyntheticDataset
from . import (
    base_loras,
    disk,
    full_finetune,
    image_data,
    loss_weights,
    optimizers,
    preservation,
    pretrained_lora,
    prior_reg,
    quantize_kwargs,
    resume,
    run_folder,
    tracking,
)
from . import checkpoint as ckpt
from .config import ConfigError, config_dict, dtype_name, fp8_cache_transposes_on
from .distributed import TrainerGroup, main_rank_only, on_main_rank  # ddp
from .ema import EMA
from .family import get_family
from .finite import FiniteGuard
from .graphs import StepGraphs, graph_plan
from .interrupt import StopRequest
from .logging import LossLog, plot_losses
from .lr_schedule import make_scheduler
from .network import add_network
from .progress import Progress
from .samples import PreviewPrompt, Previews
from .stages import StageMeter
from .streaming import NoStreaming, StreamedBlocks
from .text_training import TrainedTextEncoders, full_selection
from .timing import TimingReport
from .validation import dataset_kinds, image_size_problems, parts_needed, validate
from .validation_loss import ValidationStage


class Trainer:
    def __init__(self, cfg, *, model=None, dataset=None, verbose=True, fresh=False, handle_signals=True):
        """model / dataset: ready-made ones instead of those the config names. fresh: remove this run's earlier
        outputs and checkpoints first (otherwise the run resumes from its newest intact checkpoint, and refuses a
        folder with outputs but no checkpoint). handle_signals: Ctrl-C / SIGTERM stop after the step, saving."""
        self.cfg, self.verbose, self.fresh, self.handle_signals = cfg, verbose, fresh, handle_signals
        self.dist = TrainerGroup.from_env()  # ddp: one process, or rank r of N (distributed.py)
        self.verbose = self.verbose and self.dist.is_main  # ddp
        self._model, self._dataset = model, dataset
        self.family = get_family(cfg.model.arch)
        self.full = cfg.network.type == "full"  # full fine-tuning: the model's weights train, not adapters
        self.out = cfg.output_dir
        self.step = 0
        self.trackers = None  # TensorBoard / wandb (tracking.py), opened by train()
        self.active_time = 0.0
        self.progress = None
        self.resumed_from = None
        self.stop = None
        self.prepared = None
        self.text_encoders = None
        self.finished_lora = None  # a finished run's final LoRA: nothing to cache or train (setup, train)
        self.pretrained = None     # network.pretrained_lora_path read (pretrained_lora.PretrainedLoRA)
        self.base_loras = None     # model.lora_path / assistant_lora_path / inference_lora_path (base_loras.py)
        self.validation_images = self.validation = None  # the held-out ImageDataset; its ValidationStage
        self.streaming = NoStreaming()  # the step's streaming part (max_gpu_memory: StreamedBlocks)

    @property
    def streamer(self):
        """The BlockStreamer of the transformer's blocks under max_gpu_memory, else None."""
        return self.streaming.streamer

    @property
    def _graph_demotions(self):
        return self.streaming.demotions

    def log(self, msg):
        if self.verbose:
            (self.progress.write if self.progress is not None else print)(msg)

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self):
        """Check every input (model header, every image and caption, the run folder and its checkpoint) before
        any model is loaded; then, for image folders, cache the latents (VAE loaded, used, freed) and the text
        embeddings (text encoders loaded, used, freed); then build the transformer and its adapters and resume.
        Each stage's time and peak memory go to `self.meter` (and the result's "stages")."""
        c, t, fam = self.cfg, self.cfg.train, self.family
        for w in c.warnings:
            self.log(f"config: {w}")
        c.device = str(flame.device(c.device or ("cuda" if flame.cuda_is_available() else "cpu")))  # resolved
        # defaults go into the config: config.json tells what ran
        self.device = self.dist.join(c.device)  # ddp: cuda:LOCAL_RANK, the process group joined
        if c.network.target is None:
            c.network.target = fam.default_target
        if c.model.name_or_path is None and self._model is None:
            c.model.size = c.model.size or fam.default_size
            self.log(f"WARNING: no model file given (--model / model.name_or_path): training a RANDOM "
                     f"{c.model.size} ({fam.name}), for trying the tool only -- its "
                     f"{'weights are' if self.full else 'LoRA is'} useless on a real model")
        self.budget = parse_budget(c.max_gpu_memory)  # bytes, or None
        if self.budget is not None and self.device.type == "cuda":
            gc.collect()                            # a budget counts the whole GPU: what this process's pool
            flame.memory.empty_cache(self.device)   # caches from earlier work goes back to the driver first
        self.meter = StageMeter(self.device, log=self.log)
        self.timing = TimingReport(c.performance_log_every, self.log, self.device)  # performance_log_every
        flame.manual_seed(t.seed)
        run_folder.check_writable(self.out)  # before anything is checked, cached or loaded
        tracking.check_available(c.logging)  # a tracker asked for but not installed: said before any work

        kinds = self._check_inputs()  # the model's header and every image / sample: nothing loaded yet
        self._epochs_to_steps()       # kohya's epochs: steps from the datasets' batches

        # the run's folder: start over, resume from its newest intact checkpoint, or refuse to mix two runs
        checkpoint, state = resume.choose_checkpoint(c, self.out, fresh=self.fresh, fingerprint=self.data_fingerprint,
                                                     dist=self.dist, log=self.log)
        self.finished_lora = resume.finished_lora(self._output(), t.steps, state)
        if self.full and self.finished_lora is None and self._model is None:
            self._check_disk(early=True)   # (a full fine-tune's saves are the model's size: before the caches)

        # image folders and text prompts: latents and text embeddings cached, their encoders freed
        previews_on = bool(c.sample.sample_every) and not t.disable_sampling
        vae_needed, text_needed = parts_needed(c, kinds)
        if vae_needed or text_needed:
            # ddp: rank 0 fills the caches first, the others then find them; only rank 0 decodes previews
            self.prepared = self.dist.main_first(
                image_data.prepare, c, fam, self.dataset if self.image_data else None,
                previews_on and self.dist.is_main, device=self.device, budget=self.budget, meter=self.meter,
                log=self.log, verbose=self.verbose, shard_loader=self.dist.shard_loader,
                validation=self.validation_images, encode=self.finished_lora is None)
        self.previews = self._make_previews()

        with self.meter.stage("build"):  # (with max_gpu_memory: the resident blocks chosen by measured steps)
            self._build(checkpoint, state)
            if self.finished_lora is None:
                self._check_disk()
            if self.streamer is not None and self.finished_lora is None:  # (auto_fit measures steps)
                # the state made at the first step (a full fine-tune's: Adafactor's factored, the others' per element)
                state_bytes = sum(full_finetune.state_bytes(t.optimizer, p, t.optimizer_params) if self.full else
                                  optimizers.STATE_BYTES[t.optimizer] * p.numel() for p in self.params)
                decode_bytes = self.prepared.decode_bytes if self.prepared is not None and previews_on else 0
                # auto_fit leaves the budget set as the pool's limit (over it allocations fail rather than grow):
                # in force while this trainer trains, the limit from before put back when train() returns
                self._limit_before_fit = flame.memory.get_memory_limit(self.device)
                self.fit = self.streamer.auto_fit(self.budget, self._measure_step,
                                                  extra_bytes=state_bytes + decode_bytes + self._transposes_room(),
                                                  offload_activations=t.offload_activations)
                self.log(str(self.fit))
                self._fit_limit = flame.memory.get_memory_limit(self.device)
                self._cache_fp8_transposes()   # the resident blocks' only, now that they are chosen
        return self

    def _check_disk(self, early=False):
        """The run's saves against the free space of its folder's disk (disk.py): an error when one save does not
        fit, a warning when the ones it keeps do not. early (a full fine-tune, before anything is cached or loaded):
        counted from the model's header -- its weights on a model without storage, network.network_kwargs' filters
        applied, held in float32 unless full_bf16 -- the error alone."""
        c, fam = self.cfg, self.family
        if early:
            model = fam.empty_model(self.spec, flame.dtypes.dtype(dtype_name(c.model.dtype)), "cpu")
            trained = full_finetune.select(model, c.network, fam.lora_name_map(model))
        else:
            model, trained = self.model, self.named_adapter_parameters()
        written = list(model.parameters()) if self.full else [p for _, p in trained]
        out_bytes = flame.dtypes.dtype(dtype_name(c.save.dtype)).itemsize * sum(p.numel() for p in written)
        need = disk.save_bytes(trained, optimizer=c.train.optimizer, optimizer_params=c.train.optimizer_params,
                               ema=c.train.ema_config.use_ema, output_bytes=out_bytes,
                               held_itemsize=4 if early and not c.train.full_bf16 else None)
        error, warning = disk.disk_problems(self.out, need, c.save.max_step_saves_to_keep, final_bytes=out_bytes)
        if error:
            raise run_folder.RunFolderError(error)
        if warning and not early:
            self.log(f"WARNING: {warning}")

    def _epochs_to_steps(self):
        """train.epochs / save.save_every_epochs (kohya's max_train_epochs / save_every_n_epochs) as steps: an epoch
        is every batch of the image datasets once -- each bucket's samples in batches of the global batch size, a
        bucket's last short batch left out, as the loader draws them; regularisation images aside -- and a step takes
        gradient_accumulation_steps of them."""
        c, t = self.cfg, self.cfg.train
        if t.epochs is None and c.save.save_every_epochs is None:
            return
        batch = t.batch_size * self.dist.world_size
        ds = self.dataset
        if not hasattr(ds, "buckets"):
            raise ConfigError("train.epochs / save.save_every_epochs: count epochs of image folders; give "
                              "train.steps / save.save_every for precomputed samples")
        reg = getattr(ds, "is_reg", lambda i: False)
        per_epoch = sum(len([i for i in idx if not reg(i)]) // batch for idx in ds.buckets().values())
        if per_epoch == 0:
            raise ConfigError(f"train.epochs / save.save_every_epochs: no bucket holds a whole batch of "
                              f"{batch} samples")
        steps_per_epoch = math.ceil(per_epoch / t.gradient_accumulation_steps)
        if t.epochs is not None:
            t.steps = t.epochs * steps_per_epoch
            if t.lr_warmup_steps >= t.steps:   # (validation checked them against the default steps)
                raise ConfigError(f"train.lr_warmup_steps: {t.lr_warmup_steps} warm-up steps leave nothing of the "
                                  f"{t.steps} steps of train.epochs {t.epochs}")
        if c.save.save_every_epochs is not None:
            c.save.save_every = c.save.save_every_epochs * steps_per_epoch
        self.log(f"epochs: {per_epoch} batches of {batch} per epoch, {steps_per_epoch} steps"
                 + (f"; train.epochs {t.epochs} -> {t.steps} steps" if t.epochs is not None else "")
                 + (f"; a checkpoint every {c.save.save_every} steps" if c.save.save_every_epochs else ""))

    def _check_inputs(self):
        """What the model is (its header; nothing loaded yet), then every image / sample, checked against it (stage
        'check'); the sample size defaults to the data's. Returns the datasets' kinds (validation.dataset_kinds)."""
        c, t, fam = self.cfg, self.cfg.train, self.family
        self.spec = fam.spec_of(self._model) if self._model is not None else fam.describe_model(c.model)
        problems = fam.spec_problems(c, self.spec)
        if problems:
            raise ConfigError("; ".join(problems))
        # network.pretrained_lora_path: the file read and checked against the model and the config (which takes its
        # kind, rank and alpha where it said none) before anything is cached or loaded
        # the model without storage that the LoRA files and the quantisation exclusions are checked against: built
        # once, only when one of them is set (or the ready-made model)
        probe = self._model
        if probe is None and (c.network.pretrained_lora_path is not None or quantize_kwargs.patterns(c)
                              or any(getattr(c.model, s) for s in base_loras.SETTINGS)):
            probe = fam.empty_model(self.spec, flame.dtypes.dtype(dtype_name(c.model.dtype)), "cpu")
        self.pretrained = pretrained_lora.read(c, fam, self.spec, probe)
        if self.pretrained is not None:
            problems = validate(c, check_files=False)
            if problems:
                raise ConfigError(f"network.pretrained_lora_path {self.pretrained.path} holds {c.network.type} "
                                  f"adapters: " + "; ".join(problems))
        # model.lora_path / assistant_lora_path / inference_lora_path: each file read and checked against the model
        kinds = dataset_kinds(c) if self._dataset is None else []
        self.base_loras = base_loras.read(c, fam, self.spec, probe, self.device, self.budget,
                                          captions="images" in kinds)
        problems = quantize_kwargs.model_problems(c, fam, self.spec, probe)   # ai-toolkit's exclusions
        if problems:
            raise ConfigError("; ".join(problems))
        for line in self.base_loras.describe() if self.base_loras is not None else ():
            self.log(line)
        self.image_data = "images" in kinds
        if c.validation is not None and not self.image_data:  # (a ready-made dataset has no images to hold out)
            raise ConfigError("validation: needs image folders (datasets); this run was given precomputed samples")
        if t.train_text_encoder and not self.image_data:  # (config validation refuses the configured other kinds)
            raise ConfigError("train.train_text_encoder: needs image folders with captions; this run was given "
                              "precomputed samples")
        with self.meter.stage("check"):
            self.dataset = self._dataset if self._dataset is not None else self._build_dataset(kinds)
        for w in getattr(self.dataset, "warnings", []):
            self.log(f"data: {w}")
        if self.image_data:
            for line in self.dataset.summary():
                self.log(f"data: {line}")
        self.data_fingerprint = resume.data_fingerprint(self.dataset)
        if c.sample.height is None or c.sample.width is None:  # the dataset's resolution
            if self.image_data:
                h, w = image_data.default_sample_size(c)
            else:
                lat = self.dataset.latent_shape(0)
                h, w = lat[1] * fam.vae_scale_factor, lat[2] * fam.vae_scale_factor
            c.sample.height, c.sample.width = c.sample.height or h, c.sample.width or w
        problems = image_size_problems(c, fam, self.spec, self.dataset if self.image_data else None,
                                       self.validation_images)
        if problems:  # before any encoding and before the run's folder is touched
            raise ConfigError("; ".join(problems))
        return kinds

    def _make_previews(self):
        c, fam = self.cfg, self.family
        folder = os.path.join(self.out, "samples")
        if self.prepared is not None and self.prepared.prompts:
            return Previews(fam, c, self.prepared.prompts, folder, self.device, decode=self.prepared.decode,
                            verbose=self.verbose)
        keys = fam.sample_keys[1:]
        prompts = []
        if c.sample.prompt_embeds:
            for path in c.sample.prompt_embeds:
                with io.safe_open(path) as f:
                    cond = {k: f.get_array(k).astype(np.float32) for k in keys}
                prompts.append(PreviewPrompt(os.path.basename(path), cond))
        elif not self.image_data:
            for i in range(min(c.sample.num_samples, len(self.dataset))):
                item = self.dataset[i]
                prompts.append(PreviewPrompt(f"dataset item {i}", {k: item[k] for k in keys}, item["latents"]))
        decode = self.prepared.decode if self.prepared is not None else None
        return Previews(fam, c, prompts, folder, self.device, decode=decode, verbose=self.verbose)

    def _build(self, checkpoint, state):
        """The frozen model, its adapters, streaming / fp8, the optimizer, loader and objective; then the
        checkpoint's state."""
        c, t, fam = self.cfg, self.cfg.train, self.family
        # the frozen model and its adapters
        base_dtype = flame.dtypes.dtype(dtype_name(c.model.dtype))
        stream = self.budget is not None  # a budget: the blocks stream from host memory
        # model.lora_path / assistant_lora_path: merged into the weights as a load reads them (before fp8 storage or
        # the streamer's packing); into a ready-made or random model once it is built
        merger = self.base_loras.merger(self.device) if self.base_loras is not None else None
        on_read = merger is not None and self._model is None and c.model.name_or_path is not None
        with CIO.merge_on_read(merger) if on_read else nullcontext():
            if self._model is not None:
                self.model = self._model
            elif c.model.quantize and c.model.name_or_path:
                # model.quantize: the blocks' Linear weights read onto the device one at a time and stored in fp8
                # there, or streamed in host memory: never the whole model in its dtype on the GPU (Flux-dev's 23.8
                # GB of bf16 would not fit a 24 GB card) nor, when streamed, in host memory beside the streamer's
                # pinned copy
                with CIO.fp8_on_read(fam.block_stacks, per_tensor=bool(t.fp8_compute), device=self.device,
                                     keep="cpu" if stream else None):
                    self.model = fam.build_model(c.model, self.spec, base_dtype, self.device,
                                                 **({"stream": True} if stream else {}))
            else:
                self.model = fam.build_model(c.model, self.spec, base_dtype, self.device,
                                             **({"stream": True} if stream else {}))
        if merger is not None and not on_read:
            merger.merge_into(self.model)
        self.name_map = fam.lora_name_map(self.model)
        if self.full:   # network.type full: the model's own weights, in float32 (full_finetune.py)
            # (train.train_text_encoder: the encoders' weights too, checked and held with the model's; under
            # max_gpu_memory the blocks' weights stream and train layer-wise: _place_blocks, _make_optimizer)
            if stream and self.dist.world_size > 1:
                raise ConfigError("max_gpu_memory: a full fine-tune with streamed blocks trains on one process; "
                                  "several (ddp) would each update their blocks inside their own backward")
            te = self.prepared.text_encoders if self.prepared is not None else None
            streamed = frozenset(id(p) for s in fam.block_stacks(self.model)
                                 for p in self.model.get_submodule(s).parameters()) if stream else frozenset()
            self.n_adapted = full_finetune.make_trainable(self.model, c.network, self.name_map, device=self.device,
                                                          budget=self.budget, optimizer=t.optimizer,
                                                          keep_dtype=t.full_bf16,
                                                          optimizer_params=t.optimizer_params,
                                                          ema=t.ema_config.use_ema,
                                                          extra=full_selection(fam, te)
                                                          if te is not None else (), streamed=streamed)
            self.params = [p for _, p in full_finetune.trained_parameters(self.model)]
        else:
            self.n_adapted = add_network(self.model, c.network, fam, self.name_map, seed=t.seed, device=self.device,
                                         budget=self.budget, optimizer=t.optimizer, pretrained=self.pretrained)
            self.params = A.adapter_parameters(self.model)
        self.text_encoders = None   # train.train_text_encoder: adapters on the encoders image_data kept loaded
        if self.prepared is not None and self.prepared.text_encoders is not None:
            if self.dist.world_size > 1:
                raise ConfigError("train.train_text_encoder: not available with several processes (ddp) yet")
            self.text_encoders = TrainedTextEncoders(fam, self.prepared.text_encoders, c.network, t, seed=t.seed,
                                                     pretrained=self.pretrained)
            self.params = self.params + self.text_encoders.params
        if t.checkpoint_save == "none":
            self.model.enable_gradient_checkpointing(t.gradient_checkpointing)
        elif "save" not in inspect.signature(self.model.enable_gradient_checkpointing).parameters:
            raise ConfigError(f"train.checkpoint_save: {type(self.model).__name__}.enable_gradient_checkpointing takes "
                              f"no save= (flame_nn.GradientCheckpointingMixin's does); set it to none")
        else:
            self.model.enable_gradient_checkpointing(t.gradient_checkpointing, save=(t.checkpoint_save,))
        self.model.train()
        self.streaming, self.fit = self._place_blocks(), None

        # optimisation
        # the adapters' gradients resident only from backward to zero_grad, as PyTorch's (grad_pool lazy buffers;
        # in a graphed step allocated inside the capture). Not where gradients must outlive one backward: several
        # micro-steps accumulate into them, or ddp's all-reduce buckets are views of the flat buffers
        self._lazy_grads = self.dist.world_size == 1 and t.gradient_accumulation_steps == 1
        if self._lazy_grads:
            grad_pool.register(self.params, lazy=True)
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.max_norm = self._max_norm_apply = None   # train.scale_weight_norms (kohya's max-norm regularisation)
        if t.scale_weight_norms is not None:
            ads = [ad for _, _, ad in A.adapter_modules(self.model)] + (
                [ad for _, te in self.text_encoders.parts for _, _, ad in A.adapter_modules(te)]
                if self.text_encoders is not None else [])
            self.max_norm = MaxNorm(ads, t.scale_weight_norms)
            # queued on the device, no sync: replayed as a CUDA graph on cuda (the adapters' storage never moves)
            self._max_norm_apply = flame.cuda.graphed(self.max_norm.apply, warmup=2,
                                                      enabled=self.device.type == "cuda")
        # NaN / inf loss or gradients stop the run (finite.py); a layer-wise optimizer reports its blocks' gradients
        self.guard = FiniteGuard(self.params, self.device, also=getattr(self.optimizer, "grads_finite", None))
        self.ema = EMA(self.params, t.ema_config.ema_decay) if t.ema_config.use_ema else None
        if self.prepared is not None and self.prepared.loader is not None:
            self.loader = self.prepared.loader       # batches of one bucket, from the caches
        else:
            self.loader = SampleLoader(self.dataset, t.batch_size, seed=t.seed,
                                       shuffle=[d.shuffle for d in c.datasets] if c.datasets else True)
        self.loader = self.dist.shard_loader(self.loader)  # ddp: this rank's rows of the global batch
        self.objective = fam.objective(t)
        self.sigma_gen = flame.Generator("cpu").manual_seed(t.seed + 1)
        self.noise_gen = flame.Generator(self.device).manual_seed(t.seed + 2)
        amp_dtype = dtype_name(t.dtype)
        self.autocast_dtype = None if amp_dtype == "float32" else flame.dtypes.dtype(amp_dtype)
        # forward + backward as a CUDA graph after two eager steps (same numbers, none of the per-op host cost); with
        # streamed blocks the copies and the events between the compute and copy streams are captured too (the
        # schedule is cyclic: flame_nn.offload.streamer); not on the cpu
        self._loss_scale = 1.0 / t.gradient_accumulation_steps
        self._cond_keys = None
        drops = [f"network.{k}" for k in ("dropout", "rank_dropout", "module_dropout")
                 if not self.full and getattr(c.network, k)]
        # datasets' prior_reg (never every dataset: validation.py): batches with such samples replay graphs of
        # their own (with the prior forward), beside the plain ones
        priors = getattr(self.dataset, "has_prior_reg", False)
        use_graph, why = graph_plan(self._batch_shapes() * (2 if priors else 1), self.budget, t.cuda_graph,
                                    self.device.type == "cuda", " and ".join(drops) or None,
                                    layerwise=isinstance(self.optimizer, flame_nn.offload.LayerwiseOptimizer),
                                    streamed_prior=(preservation.enabled(t) or priors) and self.budget is not None)
        if why:
            self.log(why)
        self.graphed = StepGraphs(self._forward_backward, warmup=2) if use_graph else None

        os.makedirs(self.out, exist_ok=True)
        self.loss_log = LossLog(self.out)
        if self.prepared is not None and self.prepared.validation is not None:
            self.validation = ValidationStage(c, self.prepared.validation, fam, self.objective, device=self.device,
                                              encode=None if self.text_encoders is None else self.text_encoders.encode)
            self.log(self.validation.describe())
        self._window = {"steps": 0, "loss": 0.0, "timestep": 0.0}  # steps since the last loss-log row
        if checkpoint is not None:
            self._resume(checkpoint, state)
        write_json(os.path.join(self.out, "config.json"), config_dict(c), indent=1, default=str)

    def _place_blocks(self):
        """The step's streaming part: under max_gpu_memory every block streamed from host memory for now (setup's
        auto_fit chooses the resident ones); else NoStreaming, with model.quantize's fp8 blocks stored in place."""
        c, fam = self.cfg, self.family
        stacks = fam.block_stacks(self.model)
        # model.quantize: the blocks' frozen Linear weights stored as fp8 (e4m3, a scale per output channel; the
        # adapters keep their dtype), dequantised per layer on the fly (flame_nn.offload.fp8)
        # train.fp8_compute: one scale per weight tensor and the matmuls on the e4m3 tensor cores (fp8_compute.py)
        quantize = "fp8" if c.model.quantize else None
        compute = "fp8" if quantize and c.train.fp8_compute else None
        if self.budget is not None:
            prepare = fam.block_initializer(self.model)
            if self.full and not c.train.full_bf16:   # the blocks' trained weights held in float32 as each is packed
                prepare = _then(prepare, full_finetune.hold_in_float32)
            placed = StreamedBlocks(flame_nn.offload.BlockStreamer.for_model(
                self.model, stacks, device=self.device, quantize=quantize, fp8_compute=compute is not None,
                prepare=prepare, stream_trainable=self.full), self.device, budget=self.budget)
            if self.full:
                self.log(f"max_gpu_memory: the full fine-tune's block weights stream from pinned host memory "
                         f"({fmt_bytes(placed.streamer.host_pinned_bytes)}) and each block is updated inside "
                         f"backward as soon as its gradients are complete (a fused backward pass)"
                         + ("; train.max_grad_norm clips each block's gradients by their own norm"
                            if c.train.max_grad_norm > 0 else ""))
        else:
            if quantize:  # (those read in fp8 already -- fp8_on_read in _build -- are only switched to compute)
                for s in stacks:
                    flame_nn.offload.quantize_linear_weights_(self.model.get_submodule(s), compute=compute)
                n_q = sum(flame_nn.offload.is_fp8_linear(m) for s in stacks
                          for m in self.model.get_submodule(s).modules())
                self.log(f"model.quantize: {n_q} frozen Linear weights of the blocks stored as fp8 (e4m3)"
                         + ("; train.fp8_compute: their matmuls in fp8" if compute else ""))
            placed = NoStreaming()
        if compute and c.train.fp8_scaling == "delayed":
            n_d = sum(len(flame_nn.offload.set_fp8_scaling_(self.model.get_submodule(s), "delayed")) for s in stacks)
            self.log(f"train.fp8_scaling: delayed scaling of the activations of {n_d} fp8 Linears")
        if self.budget is None:
            self._cache_fp8_transposes()
        return placed

    def _fp8_compute_linears(self):
        stacks = [self.model.get_submodule(s) for s in self.family.block_stacks(self.model)]
        return [m for st in stacks for m in st.modules() if flame_nn.offload.is_fp8_linear(m) and m.fp8_compute]

    def _transposes_room(self):
        """Bytes auto_fit keeps for train.fp8_cache_transposes (true under max_gpu_memory): every block's transposes,
        an upper bound (only the resident blocks' are made; the fit does not weigh a block's transpose with it)."""
        if not fp8_cache_transposes_on(self.cfg.train, self.budget):
            return 0
        return sum(m.weight.numel() for m in self._fp8_compute_linears())   # 1 byte each

    def _cache_fp8_transposes(self):
        """train.fp8_cache_transposes: the fp8-compute weights' W^T made once and kept resident for the backward's
        input gradient (flame_nn.offload.cache_fp8_transposes_; a streamed block's never)."""
        if not fp8_cache_transposes_on(self.cfg.train, self.budget):
            return
        stacks = [self.model.get_submodule(s) for s in self.family.block_stacks(self.model)]
        if self.cfg.train.fp8_cache_transposes == "auto" and self.device.type == "cuda":
            # auto keeps them only where they take at most half of what the device has free now (the step's
            # activations still to come): a 24 GB card holding Flux-dev's fp8 blocks gets no second copy
            need = sum(m.weight.numel() for m in self._fp8_compute_linears())
            free = flame.cuda.mem_get_info(str(self.device))[0]
            if need > free // 2:
                self.log(f"train.fp8_cache_transposes: auto: not kept ({fmt_bytes(need)} would take more than half "
                         f"of the {fmt_bytes(free)} free); set it to true to keep them anyway")
                return
        held = sum(flame_nn.offload.cache_fp8_transposes_(st) for st in stacks)
        n = sum(len(flame_nn.offload.fp8_transposes.cached_transposes(st)) for st in stacks)
        self.log(f"train.fp8_cache_transposes: the transposed weights of {n} fp8 Linears kept resident, "
                 f"{fmt_bytes(held)}")

    def _resume(self, path, state):
        """The checkpoint at `path` loaded into what _build made (resume.restore); the step, schedule, training
        time, loss log and samples continue from it."""
        with self._host_weights():   # (a layer-wise fine-tune's streamed weights: into their host copies)
            got = resume.restore(path, state, self.named_adapter_parameters(), optimizer=self.optimizer,
                                 loader=self.loader, generators={"sigma": self.sigma_gen, "noise": self.noise_gen},
                                 ema=self.ema, ema_decay=self.cfg.train.ema_config.ema_decay, device=self.device)
        self.scheduler = self._make_scheduler(at_step=got.scheduler_epoch)
        self.step, self.active_time = got.step, got.active_time
        self._window = dict(got.log_window or self._window)
        self.loss_log.load()
        self.loss_log.truncate(self.step)
        if self.validation is not None:
            self.validation.resume(self.step)
        self.previews.restore(self.step)
        self.resumed_from = path
        self.log(f"resumed from {path} (step {self.step}, {self.active_time:.0f} s of training so far)")

    def _batch_shapes(self):
        """How many batch shapes the run draws (one per bucket that fills a batch; 1 for sample data)."""
        sampler = getattr(self.loader, "sampler", None)
        if sampler is None:
            return 1
        return sum(1 for _, items in sampler.buckets if len(items) >= sampler.batch_size)

    def _build_dataset(self, kinds):
        c, fam = self.cfg, self.family
        if "images" in kinds:
            # every image decoded, every caption read; validation.split: the held-out images leave the training set
            dataset, self.validation_images = image_data.image_datasets(c, self.verbose)
            return dataset
        if c.datasets:
            parts = [FolderDataset(d.folder_path, fam.sample_keys, lambda s: fam.check_sample(s, self.spec),
                                   d.num_repeats) for d in c.datasets]
            return parts[0] if len(parts) == 1 else ConcatDataset(parts)
        s = c.synthetic
        cond = fam.synthetic_conditioning(self.spec, s.text_length)
        if fam.control_images:   # (Flux Kontext) a control image of the target's size, as a paired dataset's
            f = fam.vae_scale_factor
            cond["control_latents"] = (fam.latent_channels, s.height // f, s.width // f)
        return SyntheticDataset(s.num_samples, s.height, s.width, cond,
                                latent_channels=fam.latent_channels, vae_scale_factor=fam.vae_scale_factor,
                                num_classes=min(4, s.num_samples), seed=s.seed)

    def _make_optimizer(self):
        """The config's optimizer over the parameter groups; a full fine-tune with streamed blocks wraps it in a
        LayerwiseOptimizer (each block updated inside backward; the rest at step())."""
        t = self.cfg.train
        opt = optimizers.make(t.optimizer, [{"params": ps, "lr": lr} for ps, lr in self._param_groups()], t.lr,
                              t.optimizer_params)
        if self.full and self.streamer is not None:
            opt = flame_nn.offload.LayerwiseOptimizer(self.streamer, opt, max_grad_norm=t.max_grad_norm,
                                                      max_grad_value=t.max_grad_value)
        return opt

    def _host_weights(self):
        """A context in which a layer-wise full fine-tune's streamed weights are cpu tensors viewing their host
        copies (BlockStreamer.on_host: saves read them, a resume writes them); nothing to do otherwise or when
        already inside one."""
        st = self.streamer
        if not self.full or st is None or st.weights_on_host:
            return nullcontext()
        return st.on_host()

    def _param_groups(self):
        """[(parameters, lr)]: the denoiser's adapters at train.lr; trained text encoders' at text_encoder_lr. With
        LoRA+ (network.loraplus_*lr_ratio) each of those splits in two: the up (B) matrices at lr x ratio after the
        rest at lr."""
        t, n = self.cfg.train, self.cfg.network
        if self.text_encoders is None:
            groups = [(self.params, t.lr, n.loraplus_unet_lr_ratio or n.loraplus_lr_ratio)]
        else:
            te = self.text_encoders.params
            groups = [(self.params[:len(self.params) - len(te)], t.lr, n.loraplus_unet_lr_ratio or n.loraplus_lr_ratio),
                      (te, t.lr if t.text_encoder_lr is None else t.text_encoder_lr,
                       n.loraplus_text_encoder_lr_ratio or n.loraplus_lr_ratio)]
        if not any(ratio for _, _, ratio in groups):
            return [(ps, lr) for ps, lr, _ in groups]
        ups = {id(p) for name, p in self.named_adapter_parameters() if name.endswith(".lora_B")}
        out = []
        for ps, lr, ratio in groups:
            if not ratio:
                out.append((ps, lr))
                continue
            out += [([p for p in ps if id(p) not in ups], lr), ([p for p in ps if id(p) in ups], lr * ratio)]
        return out

    def named_adapter_parameters(self):
        """[(name, Parameter)] of everything trained (checkpoints): the denoiser's adapters, then the text
        encoders' ('te1/...')."""
        te = self.text_encoders.named_parameters() if self.text_encoders is not None else []
        if self.full:
            return full_finetune.trained_parameters(self.model) + te
        return A.named_adapter_parameters(self.model) + te

    def _make_scheduler(self, at_step=None):
        """The config's LR schedule over the groups' rates; at_step: positioned there (resume)."""
        return make_scheduler(self.optimizer, self.cfg.train, [lr for _, lr in self._param_groups()], at_step)

    def _measure_step(self):
        """One forward + backward on the next batch for auto-fit, leaving no trace: the data position, the random
        streams and the gradients are as before."""
        saved = (self.loader.state_dict(), self.sigma_gen.get_state(), self.noise_gen.get_state(),
                 flame.get_rng_state("cpu"), flame.get_rng_state(self.device))
        paused = getattr(self.optimizer, "paused", None)   # (a layer-wise optimizer updates nothing meanwhile)
        try:
            with paused() if paused is not None else nullcontext():
                self._micro_step(self.loader.next_batch(), 1.0, graph=False)  # never a graph's warm-up or capture
        finally:
            self.optimizer.zero_grad()
            self.loader.load_state_dict(saved[0])
            self.sigma_gen.set_state(saved[1])
            self.noise_gen.set_state(saved[2])
            flame.set_rng_state(saved[3], "cpu")
            flame.set_rng_state(saved[4], self.device)

    # ------------------------------------------------------------------------------------------ one step
    def _prepare(self, batch):
        """The tensors of one micro-batch, made outside any captured region: host data copied in, noise and
        timesteps drawn. Returns the argument tuple of `_forward_backward` (fixed shapes for a fixed batch shape)
        and the timesteps."""
        x0, cond = self.family.training_inputs(self.model, preservation.without(batch), self.device, self.cfg.train)
        kept = preservation.prompt_batch(batch)   # output preservation: the preservation prompts' conditioning
        if kept is not None:
            cond.update(preservation.tagged(self.family.training_inputs(self.model, kept, self.device,
                                                                        self.cfg.train)[1]))
        cond.update(loss_weights.batch_weights(self.family, batch, x0, self.cfg.train.reg_weight))  # masks, is_reg
        if "prior_reg" in batch:   # datasets' prior_reg: their samples' mask, or None (keys the step's graphs)
            cond[prior_reg.KEY] = prior_reg.batch_mask(batch, self.device)
        if self._cond_keys is None:
            self._cond_keys = tuple(cond)
        # ddp: drawn for the global batch, this rank's rows kept (one process with the whole batch draws the same)
        noise = self.dist.shard(self.objective.sample_noise((self.dist.global_batch(x0.shape[0]), *x0.shape[1:]),
                                                            generator=self.noise_gen, device=self.device))
        t = self.dist.shard(self.objective.sample_timesteps(self.dist.global_batch(x0.shape[0]),
                                                            generator=self.sigma_gen,
                                                            num_tokens=self.family.image_seq_len(x0),
                                                            device=self.device))
        self._draw_guidance(cond, x0.shape[0])
        return (x0, noise, t) + self._perturbed(noise, x0) + tuple(cond[k] for k in self._cond_keys), t

    def _draw_guidance(self, cond, batch):
        """train.guidance_range [lo, hi] (SimpleTuner's flux_guidance_mode random-range): each sample's embedded
        guidance drawn uniformly in it from the timesteps' CPU stream (after the timesteps; for the global batch,
        this rank's rows kept), in place of train.guidance -- the preservation prompts' with the same draws."""
        rng = self.cfg.train.guidance_range
        if rng is None or "guidance" not in cond:
            return
        lo, hi = float(rng[0]), float(rng[1])
        u = flame.rand(self.dist.global_batch(batch), generator=self.sigma_gen, dtype=flame.float64, device="cpu")
        g = self.dist.shard(flame.tensor(lo + (hi - lo) * u.numpy(), dtype=cond["guidance"].dtype,
                                         device=self.device))
        for k in ("guidance", preservation.PRESERVATION + "guidance"):
            if k in cond:
                cond[k] = g

    def _perturbed(self, noise, x0):
        """(ε + γ·ξ,) -- the noise the model's input gets under train.ip_noise_gamma (kohya's input perturbation;
        ξ drawn after ε from the noise stream, γ from the timesteps' CPU stream when random) -- or () without it."""
        t = self.cfg.train
        if not t.ip_noise_gamma:
            return ()
        xi = self.dist.shard(flame.randn(self.dist.global_batch(x0.shape[0]), *x0.shape[1:], generator=self.noise_gen,
                                         dtype=flame.float32, device=self.device))
        gamma = t.ip_noise_gamma
        if t.ip_noise_gamma_random_strength:
            gamma *= float(flame.rand(1, generator=self.sigma_gen, dtype=flame.float64, device="cpu").numpy()[0])
        return (noise + gamma * xi,)

    def _forward_backward(self, x0, noise, t, *cond):
        """The loss of one micro-batch and its backward (gradients accumulate into .grad). No host synchronisation
        and no random draws: this is the region a CUDA graph captures. Returns the loss (detached). With
        train.ip_noise_gamma the first of `cond` is the perturbed noise the model's input is made with."""
        seen = noise
        if self.cfg.train.ip_noise_gamma:
            seen, cond = cond[0], cond[1:]
        cond, weights = loss_weights.split(dict(zip(self._cond_keys, cond)))
        cond, kept = preservation.split(cond)   # kept: the output-preservation prompts' conditioning, or None
        prior_mask = cond.pop(prior_reg.KEY, None)   # datasets' prior_reg samples in this batch, or None
        x_t = self.objective.noisy(x0, seen, t)
        if kept is not None:   # the prior: the model without its adapters on the preservation prompts
            with self._autocast(), no_grad(), preservation.adapters_off(self.model):
                prior = self.family.forward(self.model, x_t, t, kept)
        target = self.objective.target(x0, noise, t)
        if prior_mask is not None:   # prior_reg samples: the adapter-free prediction on their own caption
            with self._autocast(), no_grad(), preservation.adapters_off(self.model):
                base = self.family.forward(self.model, x_t, t, cond)
            target = prior_reg.blend(base, target, prior_mask)
            del base
        with self._autocast():
            if self.text_encoders is not None:  # token ids -> conditioning, through the trained encoders
                cond = self.text_encoders.encode(cond)
            pred = self.family.forward(self.model, x_t, t, cond)
        loss = self.objective.loss(pred, target, t, **weights)
        scale = self._loss_scale
        (loss * scale).backward() if scale != 1.0 else loss.backward()
        if kept is not None:   # their prediction held to the prior (its own backward: the gradients add up)
            with self._autocast():
                kept_pred = self.family.forward(self.model, x_t, t, kept)
            kept_loss = preservation.loss(kept_pred, prior, preservation.multiplier(self.cfg.train))
            (kept_loss * scale).backward() if scale != 1.0 else kept_loss.backward()
            loss = loss.detach() + kept_loss.detach()
        self.guard.watch_loss(loss)  # a device flag (captured with the step), read at the next check
        self.streaming.after_backward()  # in a capture: the copy stream's branch joins back before it ends
        return loss.detach()

    def _autocast(self):
        return autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None \
            else nullcontext()

    def _micro_step(self, batch, scale, graph=True):
        """One micro-batch's forward + backward, through the step's CUDA graph part when it has one (graph=False:
        eager, never a graph's warm-up or capture). Returns (loss, mean timestep) as device scalars: read (float)
        at the end of the step, so the host issues the clipping, optimizer and EMA work while the GPU still runs this
        forward + backward (a read here would leave the GPU idle for all of it). A graph's loss is its output
        buffer, which the next replay writes: copied."""
        args, t = self._prepare(batch)
        self._loss_scale = scale
        self.streaming.before_micro_step(self.graphed)
        if graph and self.graphed is not None and self.graphed.enabled:
            loss = self.graphed.step(args, self._forward_backward, self.streaming, rank=self.dist.rank,
                                     world_size=self.dist.world_size, log=self.log)
        else:
            loss = self._forward_backward(*args)
        return loss.detach().clone(), t.float().mean()

    def train_step(self):
        """One optimizer step; returns (loss, lr, mean timestep)."""
        t = self.cfg.train
        lr = self.scheduler.get_last_lr()[0]
        losses, ts, indices, captions = [], [], [], []
        # ddp: what trains (adapters, or a full fine-tune's weights) wrapped at the first step
        self.stop = self.dist.before_step(self.model, self.stop, self.named_adapter_parameters)
        with self.dist.accumulation(t.gradient_accumulation_steps):  # ddp: local micro-steps, then one average
            for _ in range(t.gradient_accumulation_steps):
                with self.timing.phase("data"):
                    batch = self.loader.next_batch()
                indices += list(batch.get("indices", ()))
                captions += list(batch.get("captions", ()))
                loss, s = self._micro_step(batch, 1.0 / t.gradient_accumulation_steps)
                losses.append(loss)
                ts.append(s)
        self.guard.after_backward(self.step + 1, indices, captions)  # queued on the device: no sync here
        self._step_lrs = [g["lr"] for g in self.optimizer.param_groups]
        if t.max_grad_value is not None:   # (after the finiteness guard: a clamp would hide an inf)
            flame_nn.utils.clip_grad_value_(self.params, t.max_grad_value)
        if t.max_grad_norm > 0:  # the norm stays on the device: read only when a tracker logs it
            self._grad_norm = flame_nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
        self.optimizer.step()
        if self.max_norm is not None:
            self._max_norm_apply()
        self.scheduler.step()
        # a replayed graph writes the .grad buffers it captured: keep them (zeroed), not None; lazy ones go until the
        # first capture, which allocates them in the graph's memory
        graphs = self.graphed is not None and self.graphed.enabled
        self.optimizer.zero_grad(set_to_none=not graphs or (self._lazy_grads and not self.graphed.captured))
        if self.ema is not None:
            self.ema.update()
        self.step += 1
        # the one synchronisation of the step, after its work is queued; ddp: means over the ranks
        loss, mean_t = self.dist.reduce_step(self.stop, np.mean([float(v) for v in losses]),
                                             np.mean([float(v) for v in ts]))
        return loss, lr, mean_t

    # ------------------------------------------------------------------------------------------ the loop
    def _sample_due(self, step):
        c = self.cfg
        every = 0 if c.train.disable_sampling else c.sample.sample_every
        if not every or step < c.sample.sample_start_step:
            return False
        if step == 0:
            return not c.train.skip_first_sample
        return step % every == 0 or step == c.train.steps

    def train(self):
        if not hasattr(self, "model"):
            self.setup()
        if self.finished_lora is not None:
            return self._finished_before()
        if self.fit is None:
            return self._train()
        # under max_gpu_memory: the fitted limit holds while training (again, for a second call), and the limit from
        # before the fit comes back afterwards -- the process is not left capped by a run that has ended
        flame.memory.set_memory_limit(self._fit_limit, self.device)
        try:
            return self._train()
        finally:  # (a capture that grew memory outside the pool lowered the limit: a second call keeps that)
            self._fit_limit = flame.memory.get_memory_limit(self.device)
            flame.memory.set_memory_limit(self._limit_before_fit, self.device)

    def _train(self):
        c, t = self.cfg, self.cfg.train
        te = "" if self.text_encoders is None else f" and {self.text_encoders.n_adapted} of its text encoders'"
        what = (f"all of {self.n_adapted} weight tensors of a " if self.full and not c.network.network_kwargs else
                f"{self.n_adapted} weight tensors (network_kwargs' filters) of a " if self.full else
                f"{c.network.type} r{c.network.linear} on {self.n_adapted} Linear parts of a ")
        self.log(f"training {what}{c.model.name_or_path or c.model.size}{te} "
                 f"({sum(p.numel() for p in self.params):,} parameters) on {self.device}; {len(self.dataset)} "
                 f"samples; output {self.out}"
                 + (f"; resumed at step {self.step}" if self.resumed_from else ""))
        self.progress = Progress(t.steps, initial=self.step, enabled=self.verbose, active_time=self.active_time)
        self._open_trackers()
        self.stop = StopRequest() if self.handle_signals else None
        saved_at = self.step if self.resumed_from else None
        try:
            with self.stop or nullcontext(), self.meter.stage("train"):
                # ai-toolkit's force_first_sample: a resumed run samples where it starts, as a fresh one does at 0
                forced = (self.step > 0 and t.force_first_sample and not t.skip_first_sample
                          and not t.disable_sampling and c.sample.sample_every > 0)
                if (self.step == 0 and self._sample_due(0)) or forced:
                    with self.progress.paused():
                        self.sample()
                if self.step == 0 and self.validation is not None and self.validation.due(0):
                    with self.progress.paused():
                        self.validate()
                self.progress.start()
                while self.step < t.steps:
                    with self.timing.phase("step"):
                        loss, lr, ts = self.train_step()
                    if self._results_due():  # a NaN / inf step stops the run before anything of it is kept
                        self.guard.check(self.dataset)
                    self.progress.update(1, loss=loss, lr=lr)
                    self.active_time = self.progress.active_time
                    self._log_step(loss, lr, ts)
                    if self._sample_due(self.step):
                        with self.progress.paused(), self.timing.phase("previews"):
                            self.sample()
                    if self.validation is not None and self.validation.due(self.step):
                        with self.progress.paused(), self.timing.phase("validation"):
                            self.validate()
                    if self.step % c.save.save_every == 0 or self.step == t.steps:
                        with self.progress.paused(), self.timing.phase("saves"):
                            self.save_checkpoint()
                        saved_at = self.step
                    self.timing.step_done(self.step)
                    if self.stop is not None and self.stop.requested:
                        if saved_at != self.step:
                            with self.progress.paused():
                                self.save_checkpoint()
                        break
        finally:
            self.progress.close()
            if self.trackers is not None:
                self.trackers.close()
        stopped = self.stop.requested if self.stop is not None and self.step < t.steps else None
        return self.finish(interrupted=stopped)

    def _results_due(self):
        """Whether this step writes something (a loss-log row, previews, a checkpoint, the end, a stop)."""
        c = self.cfg
        return (self.step % c.log_every == 0 or self.step == c.train.steps or self._sample_due(self.step)
                or self.step % c.save.save_every == 0 or (self.stop is not None and self.stop.requested))

    @main_rank_only  # ddp
    def _log_step(self, loss, lr, ts):
        w = self._window
        w["steps"] += 1
        w["loss"] += loss
        w["timestep"] += ts
        if self.step % self.cfg.log_every == 0 or self.step == self.cfg.train.steps:
            k = w["steps"]
            self.loss_log.append(step=self.step, loss=w["loss"] / k, lr=lr, timestep=w["timestep"] / k,
                                 seconds=self.progress.active_time)
            if self.trackers is not None and self.trackers.enabled:
                self._track(w["loss"] / k, w["timestep"] / k, k)
            self._window = {"steps": 0, "loss": 0.0, "timestep": 0.0}

    @main_rank_only  # ddp: rank 0 writes the trackers
    def _open_trackers(self):
        self.trackers = tracking.Trackers(self.cfg.logging, self.out, self.cfg.name, config=config_dict(self.cfg),
                                          resume_step=self.step)
        self._tracked_time = self.progress.active_time

    def _track(self, loss, timestep, steps):
        """The log row's scalars to TensorBoard / wandb: loss, lr per group, timestep, grad norm, time, memory."""
        values = {"train/loss": loss, "train/timestep": timestep,
                  "train/step_seconds": (self.progress.active_time - self._tracked_time) / steps}
        self._tracked_time = self.progress.active_time
        for i, lr in enumerate(getattr(self, "_step_lrs", ())):
            values[f"train/lr/group{i}"] = lr
        if getattr(self, "_grad_norm", None) is not None:
            values["train/grad_norm"] = float(self._grad_norm.item())
        got = self.max_norm.stats() if getattr(self, "max_norm", None) is not None else None
        if got is not None:   # kohya's figures of the last step's max-norm
            values.update(zip(("max_norm/keys_scaled", "max_norm/average_key_norm", "max_norm/max_key_norm"), got))
        if self.device.type == "cuda":
            values["train/memory_gib"] = flame.memory.max_memory_allocated(self.device) / 2 ** 30
        self.trackers.scalars(self.step, values)

    @on_main_rank  # ddp: rank 0 writes, the others wait and return its result
    def finish(self, interrupted=None):
        """Write the LoRA (at the end; an interrupted run's is its last checkpoint's), the loss log and plot and
        the samples grid. Returns their paths."""
        c = self.cfg
        if interrupted:
            lora = self._step_lora(self.step)
        else:
            lora = self.save_lora(self._output())
        self.loss_log.flush()
        result = {"lora": lora, "loss_csv": self.loss_log.csv_path, "loss_json": self.loss_log.json_path,
                  "steps": self.step, "losses": [r["loss"] for r in self.loss_log.rows], "interrupted": interrupted}
        if self.validation is not None:
            result.update(self.validation.results())
        if self.loss_log.rows:
            result["loss_plot"] = plot_losses(self.loss_log.rows, os.path.join(self.out, "loss.png"),
                                              title=f"{c.name}: {self.objective.name} loss",
                                              validation=self.validation.log.rows if self.validation else None)
        grid = self.previews.save_grid(os.path.join(self.out, "samples.png"))
        if grid:
            result["samples"] = grid
            result["samples_decoded"] = self.previews.decode is not None
        result["stages"] = self.meter.report()
        if self.prepared is not None:
            result["encoded"] = dict(self.prepared.encoded)
        if interrupted:
            self.log(f"stopped by {interrupted} at step {self.step}: checkpoint "
                     f"{ckpt.checkpoint_dir(self.out, self.step)}, {'model' if self.full else 'LoRA'} {lora}; "
                     f"run the same command again"
                     + (" without --fresh" if self.fresh else "") + " to resume")
        return result

    @on_main_rank  # ddp
    def _finished_before(self):
        """A run that had finished before this call: its files as they are (nothing cached, trained or written)."""
        result = run_folder.finished_outputs(self.out, self.finished_lora, self.step)
        result["stages"] = self.meter.report()
        self.log(f"this run already finished: step {self.step} of {self.cfg.train.steps}, "
                 f"{'model' if self.full else 'LoRA'} {self.finished_lora}; "
                 f"nothing to train (a larger train.steps continues it, --fresh starts over)")
        return result

    # ------------------------------------------------------------------------------------------ sampling
    @on_main_rank  # ddp
    def sample(self):
        """Sample every prompt with the current (EMA, if on) adapters; returns the step's files."""
        if not self.previews.prompts:
            return None
        self.streaming.before_sample(self.graphed)  # streamed blocks: a captured step's memory is given back
        self.model.eval()
        try:
            with self._averaged(), (self.ema.swapped() if self.ema is not None else nullcontext()), no_grad(), \
                    self.meter.stage("samples", quiet=True):
                if self.text_encoders is not None:  # the prompts as the trained encoders read them now
                    conds = self.text_encoders.preview_conditioning(
                        self.prepared.prompt_texts, self.prepared.negatives,
                        [self.previews.multiplier(i) for i in range(len(self.previews.prompts))])
                    self.previews.prompts = [p._replace(cond=cd) for p, cd in zip(self.previews.prompts, conds)]
                # model.assistant_lora_path taken out (weight -1), model.inference_lora_path added (weight 1)
                with self.base_loras.previewing(self.model, self.device) if self.base_loras is not None \
                        else nullcontext():
                    written = self.previews.run(self.model, self.step)
        finally:
            self.model.train()
        if self.trackers is not None and self.trackers.enabled:
            from PIL import Image
            for i, path in enumerate(p for p in written or () if str(p).endswith(".png")):
                with Image.open(path) as im:
                    self.trackers.image(self.step, f"samples/{i}", np.asarray(im.convert("RGB")))
        return written

    # ------------------------------------------------------------------------------------------ validation
    @on_main_rank  # ddp: rank 0 evaluates, as it samples
    def validate(self):
        """The validation loss of the adapters the previews use (EMA / averaged, eval mode), logged."""
        self.streaming.before_sample(self.graphed)  # streamed blocks: a captured step's memory is given back
        self.model.eval()
        if self.text_encoders is not None:
            self.text_encoders.train(False)
        try:
            with self._averaged(), (self.ema.swapped() if self.ema is not None else nullcontext()), \
                    self.meter.stage("validation", quiet=True):
                got = self.validation.run(self.model, self.step, self.progress.active_time if self.progress
                                          else self.active_time, self.trackers, self.autocast_dtype)
        finally:
            self.model.train()
            if self.text_encoders is not None:
                self.text_encoders.train(True)
        self.log(f"validation loss {got['loss']:.4f} at step {self.step}")
        return got

    # ------------------------------------------------------------------------------------------ saving
    @on_main_rank  # ddp
    def save_lora(self, path):
        with self._host_weights():   # (a layer-wise fine-tune's streamed weights: read from their host copies)
            return self._save_lora(path)

    def _save_lora(self, path):
        c = self.cfg
        self.guard.check(self.dataset)  # never a LoRA of NaN / inf weights
        self.guard.check_parameters(self.step)
        meta = dict(self.family.lora_metadata(c, self.model))
        meta.update({"flame.steps": self.step, "ss_output_name": c.name})
        for k, v in c.meta.items():  # ai-toolkit's `meta`, with [name] replaced by the run's name
            v = v if isinstance(v, str) else json.dumps(v)
            meta[str(k)] = v.replace("[name]", c.name)
        with self._averaged(), (self.ema.swapped() if self.ema is not None else nullcontext()):
            if self.full:   # the whole denoiser in its native layout, at save.dtype, with the run's metadata
                mine = {str(k) for k in c.meta}   # ai-toolkit's meta entries, beside FLAME's own
                meta = {k: str(v) for k, v in meta.items() if k.startswith("flame.") or k in mine}
                meta["flame.network"] = "full"
                trained_te = {} if self.text_encoders is None else {"text_encoders": self.text_encoders.modules()}
                self.family.save_model(self.model, path, flame.dtypes.dtype(dtype_name(c.save.dtype)), metadata=meta,
                                       base=c.model.name_or_path,
                                       layout="diffusers" if c.save.save_format == "diffusers" else "native",
                                       tokenizer=c.model.tokenizer_path, **trained_te)
                return path
            A.save_adapters(self.model, path, c.save.format, name_map=self.name_map, dtype=dtype_name(c.save.dtype),
                            metadata=meta,
                            text_encoders=None if self.text_encoders is None else self.text_encoders.modules())
        return path

    def _averaged(self):
        """Schedule-free AdamW: the adapters at its averaged point x while sampling and saving a LoRA (training and
        checkpoints stay at y); other optimizers: nothing."""
        averaged = getattr(self.optimizer, "averaged", None)
        return averaged() if averaged is not None else nullcontext()

    def _output(self, step=None):
        """The final (step None) or a step's LoRA / model: a .safetensors file, or a full fine-tune's diffusers
        folder (save.save_format)."""
        return run_folder.output_path(self.out, self.cfg.name, step,
                                      folder=self.full and self.cfg.save.save_format == "diffusers")

    def _step_lora(self, step):
        return self._output(step)

    @on_main_rank  # ddp
    def save_checkpoint(self):
        """Everything needed to continue exactly (checkpoint.py writes it whole or not at all), the step's LoRA
        and the loss log; then only the newest save.max_step_saves_to_keep checkpoints are kept. Nothing
        non-finite is saved (finite.py)."""
        with self._host_weights():   # (a layer-wise fine-tune's streamed weights: read from their host copies)
            return self._save_checkpoint()

    def _save_checkpoint(self):
        self.guard.check(self.dataset)
        self.guard.check_parameters(self.step)
        writers, state = resume.contents(
            self.step, self.named_adapter_parameters(), optimizer=self.optimizer, scheduler=self.scheduler,
            loader=self.loader, generators={"sigma": self.sigma_gen, "noise": self.noise_gen}, ema=self.ema,
            device=self.device, active_time=self.active_time, log_window=self._window,
            fingerprint=self.data_fingerprint, config=config_dict(self.cfg))
        self.loss_log.flush()  # first: a checkpoint promoted after a kill finds its steps' rows (resume truncates)
        if self.validation is not None:
            self.validation.log.flush()
        path = ckpt.write_checkpoint(self.out, self.step, writers, state)
        self.save_lora(self._step_lora(self.step))
        ckpt.prune(self.out, self.cfg.save.max_step_saves_to_keep, also=lambda s: [self._step_lora(s)])
        return path


def _then(first, second):
    """prepare(block) running `first` (when there is one) and then `second`."""
    def prepare(block):
        if first is not None:
            first(block)
        second(block)
    return prepare
