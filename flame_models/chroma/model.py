"""Chroma: FLUX.1-schnell's transformer without CLIP and without its per-block modulation Linears; an approximator
makes every block's modulation vectors from the timestep alone, and padded T5 tokens are masked from attention."""
import flame_core as flame
import flame_nn
from flame_nn.offload import run_block

from ..bfl.layers import EmbedND, stream_blocks
from .layers import Approximator, ChromaLastLayer, approximator_input
from .lora_keys import name_map_for
from .params import chroma_params

ATTN_PADDING = 1   # padding tokens attended after the real ones (lodestone's modify_mask_to_attend_padding)


def attended_text(txt_mask, attn_padding=ATTN_PADDING):
    """Which text tokens are attended (B, L) bool, from T5's attention mask (B, L) (1 on real tokens, right-padded):
    the real tokens plus the first `attn_padding` padding tokens (lodestone's modify_mask_to_attend_padding; the
    model was trained so)."""
    m = txt_mask.to(flame.float32)
    n = m.sum(dim=1, keepdim=True)                                                    # (B, 1) real tokens
    pos = flame.arange(m.shape[1], dtype=flame.float32, device=m.device)[None]        # (1, L)
    return pos < (n + attn_padding)


class Chroma(flame_nn.GradientCheckpointingMixin, flame_nn.Module):
    """Chroma(params) with params a ChromaParams or a preset name ('chroma', 'chroma-tiny').

    Parameter names are those of Chroma's own checkpoints (BFL's Flux names: img_in, txt_in, double_blocks,
    single_blocks, final_layer.linear, and distilled_guidance_layer); flame_models.chroma.load_chroma reads those,
    ComfyUI's (`model.diffusion_model.`-prefixed) and diffusers' layouts."""

    def __init__(self, params="chroma", *, dtype=None, device=None):
        super().__init__()
        p = chroma_params(params)
        self.params = p
        self.in_channels, self.out_channels = p.in_channels, p.out_channels
        self.hidden_size, self.num_heads = p.hidden_size, p.num_heads
        kw = dict(dtype=dtype, device=device)
        self.pe_embedder = EmbedND(dim=p.head_dim, theta=p.theta, axes_dim=p.axes_dim)
        self.img_in = flame_nn.Linear(p.in_channels, p.hidden_size, bias=True, **kw)
        self.txt_in = flame_nn.Linear(p.context_in_dim, p.hidden_size, bias=True, **kw)
        self.distilled_guidance_layer = Approximator(p.approximator_in_dim, p.approximator_hidden_dim,
                                                     p.hidden_size, p.approximator_layers, **kw)
        self.double_blocks, self.single_blocks = stream_blocks(p, modulation=False, **kw)
        self.final_layer = ChromaLastLayer(p.hidden_size, p.out_channels, **kw)

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, **kwargs):
        """Load a Chroma checkpoint (file, folder or index JSON); see flame_models.chroma.load_chroma."""
        from .loading import load_chroma
        return load_chroma(path, dtype=dtype, device=device, **kwargs)

    def adapter_name_map(self):
        """This model's Linear names (Chroma's / BFL's) <-> diffusers' (PEFT files, `to_q` targets)."""
        return name_map_for(self.params)

    def checkpointed_blocks(self):
        return [*self.double_blocks, *self.single_blocks]

    def modulations(self, timesteps, guidance=None):
        """The approximator's modulation vectors (B, mod_index_length, H) for times (B,) in [0, 1]."""
        p = self.params
        x = approximator_input(timesteps, p.mod_index_length, p.approximator_in_dim, guidance)
        return self.distilled_guidance_layer(x)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, txt_mask=None, guidance=None, attn_padding=ATTN_PADDING):
        """img (B, L_img, in_channels) packed latents, txt (B, L_txt, context_in_dim) T5 states, ids (B, L, 3) or
        (L, 3), timesteps (B,) in [0, 1], txt_mask (B, L_txt) T5's attention mask (1 on real tokens; the real
        tokens and the first `attn_padding` padding tokens are attended, the rest masked from every attention;
        None: all attended), guidance (B,) the approximator's guidance input (default 0) -> velocity
        (B, L_img, out_channels)."""
        p = self.params
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError(f"Chroma expects img (B, L, {self.in_channels}) and txt (B, L, {p.context_in_dim}), "
                             f"got {tuple(img.shape)} and {tuple(txt.shape)}")
        dtype = self.img_in.weight.dtype
        B, n_txt = img.shape[0], txt.shape[1]
        img, txt = self.img_in(img.to(dtype)), self.txt_in(txt.to(dtype))
        mods = self.modulations(timesteps.to(dtype), guidance)                     # (B, 344, H)

        pe = self.pe_embedder.joint(txt_ids, img_ids, B)
        mask = None
        if txt_mask is not None:
            if tuple(txt_mask.shape) != (B, n_txt):
                raise ValueError(f"txt_mask {tuple(txt_mask.shape)} does not fit txt {(B, n_txt)}")
            keep = attended_text(txt_mask, attn_padding)
            keep = flame.cat([keep, flame.ones(B, img.shape[1], dtype=keep.dtype, device=keep.device)], dim=1)
            mask = keep[:, None, None, :]        # keys only: a masked text query never reaches an image output

        single, depth = 3 * p.depth_single_blocks, p.depth
        for i in range(depth):
            a, b = single + 6 * i, single + 6 * depth + 6 * i
            vec = flame.cat((mods[:, a:a + 6], mods[:, b:b + 6]), dim=1)            # (B, 12, H): image, text
            img, txt = run_block(self.double_blocks, i, img, txt, vec, pe, mask)
        x = flame.cat((txt, img), dim=1)
        del img, txt
        for i in range(p.depth_single_blocks):
            x = run_block(self.single_blocks, i, x, mods[:, 3 * i:3 * i + 3], pe, mask)
        return self.final_layer(x[:, n_txt:], mods[:, -2:])
