"""Flux: the rectified-flow transformer of FLUX.1 [dev] / [schnell] (19 double-stream + 38 single-stream blocks)."""
import flame_core as flame
import flame_nn
from flame_nn.offload import run_block

from .layers import EmbedND, LastLayer, MLPEmbedder, stream_blocks, timestep_embedding
from .lora_keys import name_map_for
from .params import flux_params


class Flux(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """Flux(params) with params a FluxParams or a preset name ('flux-dev', 'flux-schnell', 'flux-tiny').

    Build without allocating weights under `flame_nn.empty_init(device=..., dtype=...)`; load with
    `Flux.from_pretrained(path, dtype=..., device=...)` (BFL or diffusers files)."""

    def __init__(self, params="flux-dev", *, dtype=None, device=None):
        super().__init__()
        p = flux_params(params)
        self.params = p
        self.in_channels, self.out_channels = p.in_channels, p.out_channels
        self.hidden_size, self.num_heads = p.hidden_size, p.num_heads
        kw = dict(dtype=dtype, device=device)
        self.pe_embedder = EmbedND(dim=p.head_dim, theta=p.theta, axes_dim=p.axes_dim)
        self.img_in = flame_nn.Linear(p.in_channels, p.hidden_size, bias=True, **kw)
        self.time_in = MLPEmbedder(256, p.hidden_size, **kw)
        self.vector_in = MLPEmbedder(p.vec_in_dim, p.hidden_size, **kw)
        self.guidance_in = MLPEmbedder(256, p.hidden_size, **kw) if p.guidance_embed else flame_nn.Identity()
        self.txt_in = flame_nn.Linear(p.context_in_dim, p.hidden_size, **kw)
        self.double_blocks, self.single_blocks = stream_blocks(p, qkv_bias=p.qkv_bias, **kw)
        self.final_layer = LastLayer(p.hidden_size, 1, p.out_channels, **kw)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """Load a BFL or diffusers checkpoint (file, folder or index JSON); see flame_models.flux.load_flux."""
        from .loading import load_flux
        return load_flux(path, dtype=dtype, device=device, **kwargs)

    def adapter_name_map(self):
        """This model's Linear names (BFL's) <-> diffusers' (PEFT files, `to_q` targets): flame_nn.adapters' default
        name_map for it."""
        return name_map_for(self.params)

    def checkpointed_blocks(self):
        """The blocks gradient checkpointing recomputes (see flame_nn.GradientCheckpointingMixin)."""
        return [*self.double_blocks, *self.single_blocks]

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, bypass_guidance=False):
        """img (B, L_img, in_channels) packed latents, txt (B, L_txt, context_in_dim) T5 states, ids (B, L, 3) or
        (L, 3), timesteps (B,) in [0, 1], y (B, vec_in_dim) CLIP pooled, guidance (B,) (flux-dev) ->
        velocity (B, L_img, out_channels). bypass_guidance: a flux-dev's conditioning vector without its guidance
        embedding, guidance left out (ai-toolkit's bypass_guidance_embedding while training)."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError(f"Flux expects img (B, L, {self.in_channels}) and txt (B, L, "
                             f"{self.params.context_in_dim}), got {tuple(img.shape)} and {tuple(txt.shape)}")
        dtype = self.img_in.weight.dtype
        img, txt, y, timesteps = img.to(dtype), txt.to(dtype), y.to(dtype), timesteps.to(dtype)

        # embed the inputs and the conditioning vector
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256))
        if self.params.guidance_embed and not bypass_guidance:
            if guidance is None:
                raise ValueError("this Flux model embeds the guidance strength (flux-dev): pass guidance=(B,) values")
            vec = vec + self.guidance_in(timestep_embedding(guidance.to(dtype), 256))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)

        # rotary positions of the joint sequence, text first
        pe = self.pe_embedder.joint(txt_ids, img_ids, img.shape[0])          # one table per token row

        # each block through run_block: checkpointed per its flag, or streamed by a BlockStreamer (flame_nn.offload)
        for i in range(len(self.double_blocks)):
            img, txt = run_block(self.double_blocks, i, img, txt, vec, pe)
        x = flame.cat((txt, img), dim=1)
        n_txt = txt.shape[1]
        del img, txt
        for i in range(len(self.single_blocks)):
            x = run_block(self.single_blocks, i, x, vec, pe)
        return self.final_layer(x[:, n_txt:], vec)
