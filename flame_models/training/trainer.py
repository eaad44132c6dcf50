"""Flux LoRA training loop: flow matching on a frozen Flux with adapters, and everything a long run needs.

    trainer = Trainer(cfg)          # a validated TrainConfig (config.load_config / config_from_dict)
    result = trainer.train()        # {"lora": path, "samples": path, "loss_plot": path, ...}

One optimizer step = `gradient_accumulation_steps` micro-batches: latents packed 2×2 -> tokens, σ drawn
(timesteps.py), x_t = (1−σ)x0 + σε, the transformer predicts v = ε − x0 at t = σ with guidance 1.0, MSE in float32,
under bf16 autocast on the GPU. Then gradient clipping, the optimizer, the LR schedule, EMA. Every `save_every`
steps a checkpoint (adapter, optimizer, scheduler, RNG states, step, data position, EMA) is written atomically to
<output>/checkpoints/step_NNNNNN/, and a restart with the same config resumes from the latest one exactly: the next
step's loss and parameters equal those of a run that never stopped. Every `sample_every` steps, latents are sampled
with the Flux Euler sampler (latent previews, preview.py) while the progress clock is paused.
"""
import gc
import json
import os
import shutil
import time
from dataclasses import asdict

import numpy as np

import flame_core as flame
import flame_nn
from flame_core import io
from flame_core.amp import autocast
from flame_core.errors import OutOfMemoryError
from flame_nn import adapters as A

from ..flux import Flux, image_ids, load_flux, pack, text_ids
from ..flux import sampling as flux_sampling
from ..flux.lora_keys import TARGET_PRESETS, name_map_for
from .config import dtype_name, max_gpu_memory_bytes
from .data import FolderDataset, Loader, SyntheticDataset, DatasetError
from .ema import EMA
from .logging import LossLog, plot_losses
from .objective import flow_matching_loss, noisy_latents, velocity_target
from .preview import save_grid
from .progress import Progress
from .timesteps import sample_sigmas

CHECKPOINTS = "checkpoints"


class ConcatDataset:
    def __init__(self, parts):
        self.parts = list(parts)
        self._index = [(i, j) for i, p in enumerate(self.parts) for j in range(len(p))]

    def __len__(self):
        return len(self._index)

    def __getitem__(self, k):
        i, j = self._index[k]
        return self.parts[i][j]


class Trainer:
    def __init__(self, cfg, *, model=None, dataset=None, verbose=True):
        self.cfg = cfg
        self.verbose = verbose
        self._model, self._dataset = model, dataset
        self.step = 0
        self.out = cfg.output_dir

    def log(self, msg):
        if self.verbose:
            (self.progress.write if getattr(self, "progress", None) else print)(msg)

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self):
        """Build everything and check every input (model, data, sample embeddings) before any step runs."""
        c, t = self.cfg, self.cfg.train
        for w in c.warnings:
            self.log(f"config: {w}")
        self.device = flame.device(c.device or ("cuda" if flame.cuda_is_available() else "cpu"))
        flame.manual_seed(t.seed)
        base_dtype = flame.dtypes.dtype(dtype_name(c.model.dtype))
        # with a memory budget the base is loaded into host memory and its blocks streamed (flame_nn.offload)
        load_to = "cpu" if c.max_gpu_memory is not None else self.device
        if self._model is not None:
            self.model = self._model
        elif c.model.name_or_path:
            self.model = load_flux(c.model.name_or_path, dtype=base_dtype, device=load_to)
        else:
            self.model = Flux(c.model.size, dtype=base_dtype, device=load_to)
        p = self.model.params
        self.name_map = name_map_for(p)
        self.dataset = self._dataset if self._dataset is not None else self._build_dataset(p)
        self.sample_embeds = self._sample_embeddings(p)

        # adapters on the frozen base
        n = c.network
        targets = TARGET_PRESETS.get(n.target, n.target) if isinstance(n.target, str) else n.target
        init_gen = flame.Generator("cpu").manual_seed(t.seed + 3)
        made = A.inject_adapters(self.model, targets, "lora" if n.type == "locon" else n.type, rank=n.linear,
                                 alpha=n.linear_alpha, dropout=n.dropout, rslora=n.rslora, lokr_factor=n.lokr_factor,
                                 lokr_full_rank=n.lokr_full_rank, name_map=self.name_map,
                                 only_if_contains=n.network_kwargs.get("only_if_contains"),
                                 ignore_if_contains=n.network_kwargs.get("ignore_if_contains"), generator=init_gen)
        self.params = A.adapter_parameters(self.model)
        self.n_adapted = len(made)
        self.model.enable_gradient_checkpointing(t.gradient_checkpointing)
        self.model.train()
        self.streamer = self.fit = None
        # model.quantize: the frozen Linear weights of the transformer blocks stored as fp8 (e4m3, a scale per output
        # channel; adapters stay in their dtype), dequantised per layer on the fly (flame_nn.offload.fp8)
        quantize = "fp8" if c.model.quantize else None
        if c.max_gpu_memory is not None:  # every block streamed for now; auto_fit chooses the resident ones below
            self.streamer = flame_nn.offload.BlockStreamer.for_model(self.model, device=self.device,
                                                                     quantize=quantize)
        elif quantize:
            n_q = sum(len(flame_nn.offload.quantize_linear_weights_(m)) for _, m in self.model.named_children()
                      if isinstance(m, flame_nn.ModuleList))
            self.log(f"model.quantize: {n_q} frozen Linear weights of the blocks stored as fp8 (e4m3)")

        # optimisation
        kw = dict(lr=t.lr, **{k: (tuple(v) if k == "betas" else float(v)) for k, v in t.optimizer_params.items()})
        opt_cls = flame_nn.optim.AdamW8bit if t.optimizer == "adamw8bit" else flame_nn.optim.AdamW
        self.optimizer = opt_cls(self.params, **kw)
        S = flame_nn.optim.lr_scheduler
        if t.lr_scheduler in ("constant", "constant_with_warmup"):
            self.scheduler = S.get_constant_schedule_with_warmup(self.optimizer, t.lr_warmup_steps)
        elif t.lr_scheduler == "linear":
            self.scheduler = S.get_linear_schedule_with_warmup(self.optimizer, t.lr_warmup_steps, t.steps)
        else:
            self.scheduler = S.get_cosine_schedule_with_warmup(self.optimizer, t.lr_warmup_steps, t.steps)
        self.ema = EMA(self.params, t.ema_config.ema_decay) if t.ema_config.use_ema else None
        self.loader = Loader(self.dataset, t.batch_size, shuffle=c.datasets[0].shuffle if c.datasets else True,
                             seed=t.seed)
        self.sigma_gen = flame.Generator("cpu").manual_seed(t.seed + 1)
        self.noise_gen = flame.Generator(self.device).manual_seed(t.seed + 2)
        amp_dtype = dtype_name(t.dtype)
        self.autocast_dtype = None if amp_dtype == "float32" else flame.dtypes.dtype(amp_dtype)
        # forward + backward as a CUDA graph after two eager steps (same numbers, none of the per-op host cost); with
        # streamed blocks the copies and the events between the compute and copy streams are captured too (the
        # schedule is cyclic: flame_nn.offload.streamer); not on the cpu
        self._loss_scale = 1.0 / t.gradient_accumulation_steps
        use_graph = t.cuda_graph and self.device.type == "cuda"
        self.graphed = flame.cuda.graphed(self._forward_backward, warmup=2, enabled=use_graph) if use_graph else None
        self._graph_generation = None  # the streamer's placement the graph was captured with
        self._graph_demotions = 0  # times a capture did not fit max_gpu_memory and blocks were demoted

        # outputs, and the latest checkpoint if there is one
        os.makedirs(self.out, exist_ok=True)
        self.loss_log = LossLog(self.out)
        self.sample_history = []
        self.resumed_from = self.resume()
        with open(os.path.join(self.out, "config.json"), "w") as f:
            json.dump(asdict(c), f, indent=1, default=str)
        if self.streamer is not None:
            n = sum(p.numel() for p in self.params)
            state = (2 if t.optimizer == "adamw8bit" else 8) * n  # moments made at the first optimizer step
            self.fit = self.streamer.auto_fit(max_gpu_memory_bytes(c.max_gpu_memory), self._measure_step,
                                              extra_bytes=state)
            self.log(str(self.fit))
        return self

    def _measure_step(self):
        """One forward + backward on the next batch for auto-fit, leaving no trace: the data position, the random
        streams and the gradients are as before."""
        saved = (self.loader.state_dict(), self.sigma_gen.get_state(), self.noise_gen.get_state(),
                 flame.get_rng_state("cpu"), flame.get_rng_state(self.device))
        try:
            self._micro_step(self.loader.next_batch(), 1.0, graph=False)  # never a graph's warm-up or capture
        finally:
            self.optimizer.zero_grad()
            self.loader.load_state_dict(saved[0])
            self.sigma_gen.set_state(saved[1])
            self.noise_gen.set_state(saved[2])
            flame.set_rng_state(saved[3], "cpu")
            flame.set_rng_state(saved[4], self.device)

    def _build_dataset(self, p):
        c = self.cfg
        if c.datasets:
            parts = [FolderDataset(d.folder_path, p.context_in_dim, p.vec_in_dim, d.num_repeats) for d in c.datasets]
            return parts[0] if len(parts) == 1 else ConcatDataset(parts)
        s = c.synthetic
        return SyntheticDataset(s.num_samples, s.height, s.width, s.text_length, p.context_in_dim, p.vec_in_dim,
                                num_classes=min(4, s.num_samples), seed=s.seed)

    def _sample_embeddings(self, p):
        """[(prompt_embeds, pooled, reference latents or None)] for the sample grid."""
        sm = self.cfg.sample
        out = []
        if sm.prompt_embeds:
            for path in sm.prompt_embeds:
                with io.safe_open(path) as f:
                    keys = f.keys()
                    if "prompt_embeds" not in keys or "pooled_prompt_embeds" not in keys:
                        raise DatasetError(f"sample.prompt_embeds: {path} needs 'prompt_embeds' and "
                                           f"'pooled_prompt_embeds' (has {keys})")
                    out.append((f.get_array("prompt_embeds").astype(np.float32),
                                f.get_array("pooled_prompt_embeds").astype(np.float32), None))
        else:
            for i in range(min(sm.num_samples, len(self.dataset))):
                it = self.dataset[i]
                out.append((it["prompt_embeds"], it["pooled_prompt_embeds"], it["latents"]))
        for txt, pooled, _ in out:
            if txt.shape[-1] != p.context_in_dim or pooled.shape[-1] != p.vec_in_dim:
                raise DatasetError(f"sample embeddings {txt.shape} / {pooled.shape} do not fit the model "
                                   f"(context {p.context_in_dim}, pooled {p.vec_in_dim})")
        return out

    # ------------------------------------------------------------------------------------------ one step
    def _prepare(self, batch):
        """The tensors of one micro-batch, made outside any captured region: host data copied in, noise and σ drawn.
        Returns the argument tuple of `_forward_backward` (fixed shapes for a given dataset) and σ."""
        t, dev = self.cfg.train, self.device
        x0 = pack(flame.tensor(batch["latents"], dtype=flame.float32, device=dev))       # (B, L, 64)
        B, L = x0.shape[0], x0.shape[1]
        h8, w8 = batch["latents"].shape[2] * 8, batch["latents"].shape[3] * 8
        noise = flame.randn(*x0.shape, generator=self.noise_gen, dtype=flame.float32, device=dev)
        sigma = sample_sigmas(t.timestep_type, B, generator=self.sigma_gen, num_tokens=L, shift=t.shift,
                              sigmoid_scale=t.sigmoid_scale, device=dev)
        txt = flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=dev)
        y = flame.tensor(batch["pooled_prompt_embeds"], dtype=flame.float32, device=dev)
        guidance = flame.full((B,), t.guidance, device=dev) if self.model.params.guidance_embed else None
        ids = (image_ids(h8, w8, B, device=dev), text_ids(txt.shape[1], B, device=dev))
        return (x0, noise, sigma, txt, y, guidance) + ids, sigma

    def _forward_backward(self, x0, noise, sigma, txt, y, guidance, img_ids, txt_ids):
        """Flow-matching loss of one micro-batch and its backward (gradients accumulate into .grad). No host
        synchronisation and no random draws: this is the region a CUDA graph captures. Returns the loss (detached)."""
        kw = dict(img=noisy_latents(x0, noise, sigma), img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=sigma,
                  y=y, guidance=guidance)
        if self.autocast_dtype is not None:
            with autocast(self.device.type, dtype=self.autocast_dtype):
                pred = self.model(**kw)
        else:
            pred = self.model(**kw)
        loss = flow_matching_loss(pred, velocity_target(x0, noise))
        scale = self._loss_scale
        (loss * scale).backward() if scale != 1.0 else loss.backward()
        if self.streamer is not None:
            self.streamer.join()  # in a capture: the copy stream's branch joins back before the capture ends
        return loss.detach()

    def _micro_step(self, batch, scale, graph=True):
        args, sigma = self._prepare(batch)
        self._loss_scale = scale
        if self.streamer is not None:
            if self.graphed is not None and self.graphed.graph is not None \
                    and self._graph_generation != self.streamer._generation:
                self.graphed.reset()  # the blocks were placed anew (set_resident): the captured slots are gone
                self._graph_generation = None
            # the slots as every step starts (and ends): sampling or an evaluation in between may have moved them;
            # a replayed step assumes them (one event when nothing moved)
            self.streamer.prime()
        if not graph or self.graphed is None or not self.graphed.enabled:
            loss = self._forward_backward(*args)
        else:
            failed = None
            try:
                loss = self.graphed(*args)
            except Exception as e:  # noqa: BLE001 - a capture that fails falls back to eager steps, said once
                if self.graphed.graph is not None or self.graphed.calls <= self.graphed.warmup:
                    raise
                # the message only: the exception's frames hold the failed capture's tensors
                failed = (isinstance(e, OutOfMemoryError), f"{type(e).__name__}: {str(e).splitlines()[0]}")
            if failed is not None:
                gc.collect()
                if self.streamer is not None:  # the failed capture recorded loads that never ran
                    self.streamer.invalidate_slots()
                gone = []
                if failed[0] and self.streamer is not None and self._graph_demotions < 3:
                    gone = flame_nn.offload.demote(self.streamer)  # a graph needs a little more than an eager step
                if gone:
                    self._graph_demotions += 1
                    self.graphed.reset()
                    self.graphed.calls = self.graphed.warmup  # capture again at the next step
                    self.log(f"CUDA graph capture did not fit the memory budget ({failed[1]}); {len(gone)} more "
                             f"blocks streamed ({len(self.streamer.resident)} resident), capturing again next step")
                else:
                    self.graphed.enabled = False
                    self.log(f"CUDA graph capture failed ({failed[1]}); training continues eagerly")
                if self.streamer is not None:
                    self.streamer.prime()
                loss = self._forward_backward(*args)
            if self.streamer is not None and self.graphed.graph is not None and self._graph_generation is None:
                self._graph_generation = self.streamer._generation
        return loss.item(), float(sigma.mean().item())

    def train_step(self):
        """One optimizer step; returns (loss, lr, mean σ)."""
        t = self.cfg.train
        lr = self.scheduler.get_last_lr()[0]
        losses, sigmas = [], []
        for _ in range(t.gradient_accumulation_steps):
            loss, s = self._micro_step(self.loader.next_batch(), 1.0 / t.gradient_accumulation_steps)
            losses.append(loss)
            sigmas.append(s)
        if t.max_grad_norm > 0:
            flame_nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        # a replayed graph accumulates into the .grad buffers it captured: keep them (zeroed), not None
        self.optimizer.zero_grad(set_to_none=self.graphed is None or not self.graphed.enabled)
        if self.ema is not None:
            self.ema.update()
        self.step += 1
        return float(np.mean(losses)), lr, float(np.mean(sigmas))

    # ------------------------------------------------------------------------------------------ the loop
    def train(self):
        if not hasattr(self, "model"):
            self.setup()
        c, t = self.cfg, self.cfg.train
        sample_every = 0 if t.disable_sampling else c.sample.sample_every
        self.log(f"training {c.network.type} r{c.network.linear} on {self.n_adapted} Linear parts of a "
                 f"{c.model.name_or_path or c.model.size} ({sum(p.numel() for p in self.params):,} parameters) "
                 f"on {self.device}; {len(self.dataset)} samples; output {self.out}"
                 + (f"; resumed at step {self.step}" if self.resumed_from else ""))
        self.progress = Progress(t.steps, initial=self.step, enabled=self.verbose)
        if sample_every and self.step == 0 and not t.skip_first_sample:
            with self.progress.paused():
                self.sample()
        self.progress.start()
        while self.step < t.steps:
            loss, lr, sigma = self.train_step()
            self.progress.update(1, loss=loss, lr=lr)
            self.loss_log.append(step=self.step, loss=loss, lr=lr, sigma=sigma, seconds=self.progress.active_time)
            if sample_every and (self.step % sample_every == 0 or self.step == t.steps):
                with self.progress.paused():
                    self.sample()
            if self.step % c.save.save_every == 0 or self.step == t.steps:
                with self.progress.paused():
                    self.save_checkpoint()
        self.progress.close()
        return self.finish()

    def finish(self):
        c = self.cfg
        lora = os.path.join(self.out, f"{c.name}.safetensors")
        self.save_lora(lora)
        self.loss_log.flush()
        result = {"lora": lora, "loss_csv": self.loss_log.csv_path, "loss_json": self.loss_log.json_path,
                  "steps": self.step, "losses": [r["loss"] for r in self.loss_log.rows]}
        if self.loss_log.rows:
            result["loss_plot"] = plot_losses(self.loss_log.rows, os.path.join(self.out, "loss.png"),
                                              title=f"{c.name}: flow-matching loss")
        if self.sample_history:
            result["samples"] = self.save_sample_grid(os.path.join(self.out, "samples.png"))
        return result

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self):
        """Sample one latent per sample prompt with the current (EMA, if on) adapters; keep them for the grid."""
        sm, dev = self.cfg.sample, self.device
        if not self.sample_embeds:
            return None
        h, w = self._sample_size()
        lat = []
        self.model.eval()
        ctx = self.ema.swapped() if self.ema is not None else _nullcontext()
        with ctx, flame.no_grad():
            for i, (txt, pooled, _) in enumerate(self.sample_embeds):
                seed = sm.seed + (i if sm.walk_seed else 0)
                z = flux_sampling.sample(self.model, flame.tensor(txt[None], device=dev),
                                         flame.tensor(pooled[None], device=dev), height=h, width=w,
                                         steps=sm.sample_steps,
                                         guidance=sm.guidance_scale if self.model.params.guidance_embed else None,
                                         seed=seed)
                lat.append(z[0].cpu().numpy())
        self.model.train()
        self.sample_history.append((self.step, lat))
        folder = os.path.join(self.out, "samples")
        os.makedirs(folder, exist_ok=True)
        return save_grid([[x] for x in lat], os.path.join(folder, f"step_{self.step:06d}.png"))

    def _sample_size(self):
        ref = self.sample_embeds[0][2]
        if self.cfg.synthetic is not None and not self.cfg.datasets and ref is not None:
            return ref.shape[1] * 8, ref.shape[2] * 8  # the synthetic data's own size
        return self.cfg.sample.height, self.cfg.sample.width

    def save_sample_grid(self, path):
        """Rows: sample prompts; columns: the prompt's training latents (when known), then each sampling step."""
        refs = [r for _, _, r in self.sample_embeds]
        size = self.sample_history[0][1][0].shape
        use_ref = all(r is not None and r.shape == size for r in refs)
        rows = [([refs[i]] if use_ref else []) + [lat[i] for _, lat in self.sample_history]
                for i in range(len(self.sample_embeds))]
        labels = (["data"] if use_ref else []) + [f"step {s}" for s, _ in self.sample_history]
        return save_grid(rows, path, labels=labels)

    # ------------------------------------------------------------------------------------------ saving
    def save_lora(self, path):
        c = self.cfg
        ctx = self.ema.swapped() if self.ema is not None else _nullcontext()
        with ctx:
            A.save_adapters(self.model, path, c.save.format, name_map=self.name_map, dtype=dtype_name(c.save.dtype),
                            metadata={"flame.base_model": c.model.name_or_path or c.model.size,
                                      "ss_base_model_version": "flux1", "modelspec.architecture": "flux-1-dev/lora",
                                      "flame.steps": self.step, "ss_output_name": c.name})
        return path

    def _checkpoint_dir(self, step):
        return os.path.join(self.out, CHECKPOINTS, f"step_{step:06d}")

    def save_checkpoint(self):
        """Everything needed to continue exactly, written to a temp folder and renamed (never half-written)."""
        final = self._checkpoint_dir(self.step)
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        io.save_file({k: p for k, p in A.named_adapter_parameters(self.model)}, os.path.join(tmp, "adapter.safetensors"))
        opt = self.optimizer.state_dict()
        tensors, scalars = {}, {}
        for i, st in opt["state"].items():
            for k, v in st.items():
                if isinstance(v, flame.Tensor):
                    tensors[f"{i}.{k}"] = v
                else:
                    scalars[f"{i}.{k}"] = v
        if tensors:
            io.save_file(tensors, os.path.join(tmp, "optimizer.safetensors"))
        if self.ema is not None:
            io.save_file({str(i): s for i, s in enumerate(self.ema.shadow)}, os.path.join(tmp, "ema.safetensors"))
        state = {"step": self.step, "loader": self.loader.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "optimizer": {"scalars": scalars, "param_groups": opt["param_groups"]},
                 "rng": {"sigma": self.sigma_gen.get_state(), "noise": self.noise_gen.get_state(),
                         "default_cpu": flame.get_rng_state("cpu"),
                         "default_device": flame.get_rng_state(self.device)},
                 "ema": None if self.ema is None else {"decay": self.ema.decay, "num_updates": self.ema.num_updates},
                 "active_time": self.progress.active_time if getattr(self, "progress", None) else 0.0,
                 "time": time.time()}
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(state, f, default=_json_default)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.loss_log.flush()
        lora = os.path.join(self.out, f"{self.cfg.name}_{self.step:06d}.safetensors")
        self.save_lora(lora)
        self._prune()
        return final

    def _prune(self):
        keep = self.cfg.save.max_step_saves_to_keep
        steps = self.checkpoint_steps()
        for s in steps[:-keep] if len(steps) > keep else []:
            shutil.rmtree(self._checkpoint_dir(s), ignore_errors=True)
            lora = os.path.join(self.out, f"{self.cfg.name}_{s:06d}.safetensors")
            if os.path.exists(lora):
                os.remove(lora)

    def checkpoint_steps(self):
        folder = os.path.join(self.out, CHECKPOINTS)
        if not os.path.isdir(folder):
            return []
        steps = []
        for d in os.listdir(folder):
            if d.startswith("step_") and not d.endswith(".tmp") and os.path.exists(os.path.join(folder, d,
                                                                                                 "state.json")):
                steps.append(int(d[5:]))
        return sorted(steps)

    def resume(self):
        """Load the latest checkpoint of this run's folder, if any. Returns its path or None."""
        steps = self.checkpoint_steps()
        if not steps:
            return None
        path = self._checkpoint_dir(steps[-1])
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        saved = io.load_file(os.path.join(path, "adapter.safetensors"))
        named = A.named_adapter_parameters(self.model)
        names = [k for k, _ in named]
        if sorted(saved) != sorted(names):
            raise A.AdapterFormatError(f"checkpoint {path} holds other adapter parameters than this config makes "
                                       f"(network type, rank or targets changed?): file has {len(saved)}, the "
                                       f"model {len(names)}; e.g. {sorted(set(saved) ^ set(names))[:4]}")
        with flame.no_grad():
            for k, p in named:
                if tuple(saved[k].shape) != tuple(p.shape):
                    raise A.AdapterFormatError(f"checkpoint {path}: {k} has shape {tuple(saved[k].shape)}, the "
                                               f"model's is {tuple(p.shape)}")
                p.copy_(saved[k])
        opt_tensors = {}
        opt_path = os.path.join(path, "optimizer.safetensors")
        if os.path.exists(opt_path):
            opt_tensors = io.load_file(opt_path, device=self.device)
        st = {}
        for k, v in list(opt_tensors.items()) + list(state["optimizer"]["scalars"].items()):
            i, name = k.split(".", 1)
            st.setdefault(int(i), {})[name] = v
        groups = state["optimizer"]["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        self.optimizer.load_state_dict({"state": st, "param_groups": groups})
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.sigma_gen.set_state(state["rng"]["sigma"])
        self.noise_gen.set_state(state["rng"]["noise"])
        flame.set_rng_state(state["rng"]["default_cpu"], "cpu")
        flame.set_rng_state(state["rng"]["default_device"], self.device)
        if self.ema is not None:
            if state["ema"] is None:
                raise ValueError(f"checkpoint {path} was written without EMA; disable use_ema or start a new run")
            shadow = io.load_file(os.path.join(path, "ema.safetensors"), device=self.device)
            self.ema.load_state_dict({**state["ema"], "shadow": [shadow[str(i)] for i in range(len(shadow))]})
        self.step = int(state["step"])
        self.loss_log.load()
        self.loss_log.truncate(self.step)
        self.log(f"resumed from {path} (step {self.step})")
        return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"cannot store {type(o).__name__} in a checkpoint's state.json")


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
