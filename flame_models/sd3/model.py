"""MMDiT: the rectified-flow transformer of Stable Diffusion 3 / 3.5 (Large, Large Turbo) and MMDiT-X (3.5 Medium,
whose first joint blocks add an image-only attention)."""
import flame_nn
from flame_nn.offload import run_block

from ..blocks.layers import LastLayer
from . import ops
from .layers import Embedder, JointBlock, PatchEmbed, timestep_features
from .params import sd3_params


class MMDiT(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """MMDiT(params) with params an SD3Params or a preset name ('sd3.5-large', 'sd3.5-large-turbo', 'sd3.5-medium',
    'sd3.5-tiny').

    Build without allocating weights under `flame_nn.empty_init(device=..., dtype=...)`; load with
    `MMDiT.from_pretrained(path, dtype=..., device=...)` (SAI single files or diffusers folders).
    Parameter names are SAI's checkpoint keys without the `model.diffusion_model.` prefix."""

    def __init__(self, params="sd3.5-large", *, dtype=None, device=None):
        super().__init__()
        p = sd3_params(params)
        self.params = p
        self.in_channels, self.out_channels, self.patch_size = p.in_channels, p.out_channels, p.patch_size
        self.hidden_size, self.num_heads = p.hidden_size, p.num_heads
        kw = dict(dtype=dtype, device=device)
        self.x_embedder = PatchEmbed(p.patch_size, p.in_channels, p.hidden_size, **kw)
        self.t_embedder = Embedder(256, p.hidden_size, **kw)
        self.y_embedder = Embedder(p.pooled_in_dim, p.hidden_size, **kw)
        self.context_embedder = flame_nn.Linear(p.context_in_dim, p.hidden_size, bias=True, **kw)
        # a stored buffer (loaded from the checkpoint, never trained); under empty_init a placeholder like the
        # parameters' (no memory) that loading -- load_state_dict, with or without assign -- gives its storage
        w = self.x_embedder.proj.weight
        side = p.pos_embed_max_size
        if flame_nn.is_empty_init():
            table = flame_nn.Parameter.meta((1, side * side, p.hidden_size), dtype=w.dtype, device=w.device,
                                            requires_grad=False)
        else:
            table = ops.pos_embed_tensor(p, w.dtype, w.device)
        self.register_buffer("pos_embed", table)
        self.joint_blocks = flame_nn.ModuleList(
            JointBlock(p.hidden_size, p.num_heads, p.qk_norm, pre_only=(i == p.depth - 1),
                       dual_attention=(i in p.dual_attention_layers), **kw)
            for i in range(p.depth))
        self.final_layer = LastLayer(p.hidden_size, p.patch_size, p.out_channels, **kw)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """Load an SAI or diffusers checkpoint (file, folder or index JSON); see flame_models.sd3.load_sd3."""
        from .loading import load_sd3
        return load_sd3(path, dtype=dtype, device=device, **kwargs)

    def checkpointed_blocks(self):
        """The joint blocks, which gradient checkpointing recomputes (see flame_nn.GradientCheckpointingMixin)."""
        return list(self.joint_blocks)

    def adapter_name_map(self):
        """This model's (SAI) Linear names <-> diffusers' (PEFT files, `to_q` targets): flame_nn.adapters' default
        name_map for it."""
        from .lora_keys import name_map_for
        return name_map_for(self.params)

    def cropped_pos_embed(self, height, width):
        """The centre crop of the position table for latents of height x width: (1, h*w, H)."""
        p = self.patch_size
        return ops.crop_pos_embed(self.pos_embed, self.params.pos_embed_max_size, height // p, width // p)

    def forward(self, x, t, y, context, skip_layers=None):
        """x (B, in_channels, H, W) latents, t (B,) timesteps = 1000 sigma, y (B, pooled_in_dim) pooled text
        embedding, context (B, L, context_in_dim) token embeddings -> velocity (B, out_channels, H, W).

        skip_layers: joint block indices to leave out (skip-layer guidance)."""
        p = self.params
        if x.ndim != 4 or x.shape[1] != p.in_channels or x.shape[2] % p.patch_size or x.shape[3] % p.patch_size:
            raise ValueError(f"MMDiT expects latents (B, {p.in_channels}, H, W) with H and W multiples of "
                             f"{p.patch_size}, got {tuple(x.shape)}")
        B = x.shape[0]
        if (context.ndim != 3 or context.shape[0] != B or context.shape[2] != p.context_in_dim
                or tuple(y.shape) != (B, p.pooled_in_dim) or tuple(t.shape) != (B,)):
            raise ValueError(f"MMDiT expects t ({B},), y ({B}, {p.pooled_in_dim}) and context ({B}, L, "
                             f"{p.context_in_dim}) for latents {tuple(x.shape)}, got t {tuple(t.shape)}, y "
                             f"{tuple(y.shape)}, context {tuple(context.shape)}")
        if getattr(self.pos_embed, "is_meta", False):
            raise flame_nn.MetaTensorError("MMDiT.pos_embed is still a placeholder (built under empty_init): load "
                                           "the checkpoint first")
        height, width = x.shape[2], x.shape[3]
        dtype = self.x_embedder.proj.weight.dtype

        # embed the latents (plus their window of the position table), the conditioning vector and the context
        h = self.x_embedder(x.to(dtype)) + self.cropped_pos_embed(height, width).to(dtype)   # (B, Lx, H)
        c = self.t_embedder(timestep_features(t).to(dtype)) + self.y_embedder(y.to(dtype))  # (B, H)
        ctx = self.context_embedder(context.to(dtype))                                       # (B, Lc, H)

        # each block through run_block: checkpointed per its flag, or streamed by a BlockStreamer (flame_nn.offload)
        skip = frozenset(skip_layers or ())
        for i in range(len(self.joint_blocks)):
            if i not in skip:
                ctx, h = run_block(self.joint_blocks, i, ctx, h, c)
        del ctx
        h = self.final_layer(h, c)                                                           # (B, Lx, p*p*C)
        return ops.unpatchify(h, height, width, self.patch_size, self.out_channels)
