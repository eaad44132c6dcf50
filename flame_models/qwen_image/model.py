"""Qwen-Image's transformer: 60 dual-stream MMDiT blocks over [text, image] tokens (no single-stream blocks), a
timestep-only conditioning vector, 3-axis RoPE with centred image positions, and the text-padding mask. Parameter
names are diffusers' QwenImageTransformer2DModel's (the Qwen release's checkpoint keys); the forward takes
diffusers' argument names."""
import flame_core as flame
import flame_nn
from flame_nn.offload import run_block

from ..bfl.ops import rope_freqs, rope_rows
from .layers import AdaLayerNormOut, QwenImageTransformerBlock, RMSNorm, TimestepProjEmbeddings
from .params import qwen_image_params
from .positions import image_shapes, position_ids


class QwenImageTransformer2DModel(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """QwenImageTransformer2DModel(params) with params a QwenImageParams or a preset name ('qwen-image',
    'qwen-image-tiny'). flame_models.qwen_image.load_qwen_image reads diffusers folders and ComfyUI files."""

    def __init__(self, params="qwen-image", *, dtype=None, device=None):
        super().__init__()
        p = qwen_image_params(params)
        self.params = p
        D = p.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.time_text_embed = TimestepProjEmbeddings(D, **kw)
        self.txt_norm = RMSNorm(p.joint_attention_dim, **kw)
        self.img_in = flame_nn.Linear(p.in_channels, D, bias=True, **kw)
        self.txt_in = flame_nn.Linear(p.joint_attention_dim, D, bias=True, **kw)
        self.transformer_blocks = flame_nn.ModuleList(
            QwenImageTransformerBlock(D, p.num_attention_heads, p.attention_head_dim, p.mlp_hidden_dim, **kw)
            for _ in range(p.num_layers))
        self.norm_out = AdaLayerNormOut(D, **kw)
        self.proj_out = flame_nn.Linear(D, p.proj_out_dim, bias=True, **kw)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """Load a checkpoint (diffusers folder / file, ComfyUI file); see flame_models.qwen_image.load_qwen_image."""
        from .loading import load_qwen_image
        return load_qwen_image(path, dtype=dtype, device=device, **kwargs)

    def adapter_name_map(self):
        """The Linears' names <-> diffusers' (PEFT files): the same names, each Linear whole."""
        from flame_nn.adapters.formats import NameMap
        return NameMap({n: [(n, [(0, m.weight.shape[0])])] for n, m in self.named_modules()
                        if isinstance(m, flame_nn.Linear)})

    def checkpointed_blocks(self):
        return list(self.transformer_blocks)

    def rotary_tables(self, img_shapes, batch_size, n_img, n_txt, device):
        """The RoPE rotations of [text, image] per token row (B*L, 1, 1, D/2, 2, 2), float32."""
        images = image_shapes(img_shapes, batch_size, n_img)
        ids = position_ids(images, n_txt, device=device)
        return rope_rows(rope_freqs(ids, self.params.axes_dims_rope, self.params.theta), batch_size)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, timestep=None,
                img_shapes=None):
        """hidden_states (B, L_img, in_channels) packed latents, encoder_hidden_states (B, L_txt,
        joint_attention_dim) the text encoder's states, encoder_hidden_states_mask (B, L_txt) 1 / True on valid
        tokens (padded ones are masked as keys from every attention; None: all valid), timestep (B,) sigma in
        [0, 1] (the pipeline's t / 1000), img_shapes [(frames, rows, cols)] of the token grid per sample (diffusers'
        [[(1, H/16, W/16)]] * B) -> the velocity (B, L_img, patch^2 * out_channels)."""
        p = self.params
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != p.in_channels:
            raise ValueError(f"hidden_states must be (B, L_img, {p.in_channels}), got {tuple(hidden_states.shape)}")
        B, n_img = hidden_states.shape[:2]
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != B \
                or encoder_hidden_states.shape[-1] != p.joint_attention_dim:
            raise ValueError(f"encoder_hidden_states must be ({B}, L_txt, {p.joint_attention_dim}), got "
                             f"{tuple(encoder_hidden_states.shape)}")
        n_txt = encoder_hidden_states.shape[1]
        if timestep is None:
            raise ValueError("timestep is required: sigma (B,) in [0, 1]")
        if timestep.ndim == 0:
            timestep = timestep.reshape(1).expand(B)
        if tuple(timestep.shape) != (B,):
            raise ValueError(f"timestep must be ({B},), got {tuple(timestep.shape)}")
        mask = None
        if encoder_hidden_states_mask is not None:
            if tuple(encoder_hidden_states_mask.shape) != (B, n_txt):
                raise ValueError(f"encoder_hidden_states_mask {tuple(encoder_hidden_states_mask.shape)} does not fit "
                                 f"encoder_hidden_states {(B, n_txt)}")
            keep = encoder_hidden_states_mask != 0
            keep = flame.cat([keep, flame.ones(B, n_img, dtype=keep.dtype, device=keep.device)], dim=1)
            mask = keep[:, None, None, :]     # keys only: a padded text query never reaches an image output
        pe = self.rotary_tables(img_shapes, B, n_img, n_txt, hidden_states.device)

        dtype = self.img_in.weight.dtype
        img = self.img_in(hidden_states.to(dtype))
        txt = self.txt_in(self.txt_norm(encoder_hidden_states.to(dtype)).to(dtype))
        temb = self.time_text_embed(timestep)
        for i in range(p.num_layers):
            img, txt = run_block(self.transformer_blocks, i, img, txt, temb, pe, mask)
        del txt
        return self.proj_out(self.norm_out(img, temb))
