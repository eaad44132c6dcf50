"""Checkpoint layouts of the SDXL UNet: SAI names (the model's own) and diffusers' names, and finding the UNet inside
a file (its prefix) or naming what a file that holds none looks like.

SAI -> diffusers (nrb = num_res_blocks; diffusers' up_blocks.0 is the deepest level):
    time_embed.0 / .2                   time_embedding.linear_1 / linear_2
    label_emb.0.0 / .0.2                add_embedding.linear_1 / linear_2
    input_blocks.0.0                    conv_in
    input_blocks.i.0  (ResBlock)        down_blocks.l.resnets.r             l, r = divmod(i - 1, nrb + 1)
    input_blocks.i.0.op                 down_blocks.l.downsamplers.0.conv   (r == nrb)
    input_blocks.i.1                    down_blocks.l.attentions.r
    middle_block.0 / .1 / .2            mid_block.resnets.0 / attentions.0 / resnets.1
    output_blocks.i.0                   up_blocks.b.resnets.j               b, j = divmod(i, nrb + 1)
    output_blocks.i.1                   up_blocks.b.attentions.j
    output_blocks.i.{1,2}.conv          up_blocks.b.upsamplers.0.conv       (.1 when the level has no attention)
    out.0 / out.2                       conv_norm_out / conv_out
ResBlock parts: in_layers.0 norm1, in_layers.2 conv1, emb_layers.1 time_emb_proj, out_layers.0 norm2, out_layers.3
conv2, skip_connection conv_shortcut. Transformer parts keep their names. (diffusers' own single-file converter,
convert_ldm_unet_checkpoint, maps the SAI names back to exactly these: tests/fixtures/make_sdxl_fixtures.py.)
"""
import re

from .. import checkpoint_io as CIO

SAI_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
DIFFUSERS_PREFIXES = ("unet.",)
SAI_PROBE = "input_blocks.0.0.weight"
DIFFUSERS_PROBE = "conv_in.weight"

_RES_TO_DIFFUSERS = (("in_layers.0.", "norm1."), ("in_layers.2.", "conv1."), ("emb_layers.1.", "time_emb_proj."),
                     ("out_layers.0.", "norm2."), ("out_layers.3.", "conv2."), ("skip_connection.", "conv_shortcut."))
_TOP_TO_DIFFUSERS = {"time_embed.0.": "time_embedding.linear_1.", "time_embed.2.": "time_embedding.linear_2.",
                     "label_emb.0.0.": "add_embedding.linear_1.", "label_emb.0.2.": "add_embedding.linear_2.",
                     "input_blocks.0.0.": "conv_in.", "out.0.": "conv_norm_out.", "out.2.": "conv_out."}


def _renamed(key, pairs, back=False):
    """`key` with the first matching prefix of (SAI, diffusers) `pairs` swapped for the other one (diffusers -> SAI
    when `back`), or None when none matches."""
    for sai, diffusers in pairs:
        old, new = (diffusers, sai) if back else (sai, diffusers)
        if key.startswith(old):
            return new + key[len(old):]
    return None


def _res(rest, back=False):
    """A ResBlock part's other name; KeyError when it is none of the ResBlock's."""
    out = _renamed(rest, _RES_TO_DIFFUSERS, back)
    if out is None:
        raise KeyError(rest)
    return out


def _res_back(rest):
    return _res(rest, back=True)


def sai_to_diffusers_key(key, num_res_blocks):
    """The diffusers name of an SAI UNet key (prefix stripped). KeyError for a key outside the UNet's layout."""
    top = _renamed(key, _TOP_TO_DIFFUSERS.items())
    if top is not None:
        return top
    n = num_res_blocks + 1
    try:
        m = re.match(r"^input_blocks\.(\d+)\.(\d+)\.(.+)$", key)
        if m:
            i, part, rest = int(m[1]), int(m[2]), m[3]
            if i == 0:                                        # conv_in is input_blocks.0.0 (handled above)
                raise KeyError(key)
            level, r = divmod(i - 1, n)
            if part == 0 and rest.startswith("op."):
                return f"down_blocks.{level}.downsamplers.0.conv.{rest[3:]}"
            if part == 0:
                return f"down_blocks.{level}.resnets.{r}.{_res(rest)}"
            if part == 1:
                return f"down_blocks.{level}.attentions.{r}.{rest}"
        m = re.match(r"^middle_block\.([012])\.(.+)$", key)
        if m:
            part, rest = int(m[1]), m[2]
            if part == 1:
                return f"mid_block.attentions.0.{rest}"
            return f"mid_block.resnets.{part // 2}.{_res(rest)}"
        m = re.match(r"^output_blocks\.(\d+)\.(\d+)\.(.+)$", key)
        if m:
            i, part, rest = int(m[1]), int(m[2]), m[3]
            b, j = divmod(i, n)
            if part in (1, 2) and rest.startswith("conv."):
                return f"up_blocks.{b}.upsamplers.0.conv.{rest[5:]}"
            if part == 0:
                return f"up_blocks.{b}.resnets.{j}.{_res(rest)}"
            if part == 1:
                return f"up_blocks.{b}.attentions.{j}.{rest}"
    except KeyError:
        pass
    raise KeyError(f"no diffusers name for the SDXL UNet (SAI) key {key!r}")


def diffusers_to_sai_key(key, num_res_blocks, up_levels_with_attention):
    """The SAI name of a diffusers UNet key. `up_levels_with_attention`: the set of diffusers up_blocks indices that
    have attentions (it decides whether an upsampler is output_blocks.i.1.conv or .2.conv)."""
    top = _renamed(key, _TOP_TO_DIFFUSERS.items(), back=True)
    if top is not None:
        return top
    n = num_res_blocks + 1
    try:
        m = re.match(r"^down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.(.+)$", key)
        if m:
            level, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            if kind == "downsamplers":
                if j != 0 or not rest.startswith("conv."):
                    raise KeyError(key)
                return f"input_blocks.{(level + 1) * n}.0.op.{rest[5:]}"
            if j >= num_res_blocks:
                raise KeyError(key)
            i = 1 + level * n + j
            return f"input_blocks.{i}.0.{_res_back(rest)}" if kind == "resnets" else f"input_blocks.{i}.1.{rest}"
        m = re.match(r"^mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", key)
        if m:
            kind, j, rest = m[1], int(m[2]), m[3]
            if kind == "attentions" and j == 0:
                return f"middle_block.1.{rest}"
            if kind == "resnets" and j in (0, 1):
                return f"middle_block.{2 * j}.{_res_back(rest)}"
        m = re.match(r"^up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.(.+)$", key)
        if m:
            b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            if kind == "upsamplers":
                if j != 0 or not rest.startswith("conv."):
                    raise KeyError(key)
                part = 2 if b in up_levels_with_attention else 1
                return f"output_blocks.{b * n + num_res_blocks}.{part}.{rest}"
            if j > num_res_blocks:
                raise KeyError(key)
            i = b * n + j
            return f"output_blocks.{i}.0.{_res_back(rest)}" if kind == "resnets" else f"output_blocks.{i}.1.{rest}"
    except KeyError:
        pass
    raise KeyError(f"no SAI name for the diffusers UNet key {key!r}")


def diffusers_layout_facts(keys):
    """(num_res_blocks, up_blocks indices with attentions) read from diffusers key names."""
    resnets = {int(m[1]) for k in keys for m in [re.match(r"^down_blocks\.0\.resnets\.(\d+)\.", k)] if m}
    nrb = max(resnets) + 1 if resnets else 0
    attn = {int(m[1]) for k in keys for m in [re.match(r"^up_blocks\.(\d+)\.attentions\.", k)] if m}
    return nrb, attn


# ----------------------------------------------------------------------------- finding the UNet in a file
def find_prefix(keys):
    """(prefix, layout) of the UNet in these keys -- ('model.diffusion_model.', 'sai'), ('', 'diffusers'), ... --
    or (None, None) when no UNet is there."""
    keys = set(keys)
    for prefix in SAI_PREFIXES + ("",):
        if prefix + SAI_PROBE in keys:
            return prefix, "sai"
    for prefix in DIFFUSERS_PREFIXES + ("",):
        if prefix + DIFFUSERS_PROBE in keys and any(k.startswith(prefix + "down_blocks.") for k in keys):
            return prefix, "diffusers"
    return None, None


def describe(keys):
    """A few words on what a file with these tensor names is, for errors."""
    return CIO.describe_keys(keys)[1]
