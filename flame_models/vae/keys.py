"""Checkpoint layouts of the VAE: LDM names (BFL ae.safetensors, SAI / ComfyUI single files) are the model's own;
diffusers renames them. Plus: finding the VAE inside a full checkpoint (its prefix) and naming what a file that
holds no VAE looks like, from its key names alone.

LDM -> diffusers:
    {enc,dec}.norm_out                    conv_norm_out
    encoder.down.i.block.j                encoder.down_blocks.i.resnets.j          (nin_shortcut -> conv_shortcut)
    encoder.down.i.downsample.conv        encoder.down_blocks.i.downsamplers.0.conv
    decoder.up.i.block.j                  decoder.up_blocks.(n-1-i).resnets.j
    decoder.up.i.upsample.conv            decoder.up_blocks.(n-1-i).upsamplers.0.conv
    {enc,dec}.mid.block_1 / block_2       mid_block.resnets.0 / 1
    {enc,dec}.mid.attn_1.{norm,q,k,v,proj_out}
                                          mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}  (Linear)
                                          or the older {group_norm,query,key,value,proj_attn}
"""
import re

from .. import checkpoint_io as CIO

VAE_PREFIXES = ("first_stage_model.", "vae.", "")   # SAI full checkpoints, ComfyUI all-in-one files, bare VAEs
PROBES = ("encoder.conv_in.weight", "decoder.conv_in.weight")  # the same in both layouts
VAE_ROOTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_ATTN_OLD = {"norm": "group_norm", "q": "query", "k": "key", "v": "value", "proj_out": "proj_attn"}
_ATTN_WEIGHT = re.compile(r"^(encoder|decoder)\.mid\.attn_1\.(q|k|v|proj_out)\.weight$")


def is_attention_weight(ldm_key):
    """The 1x1-conv weights (C, C, 1, 1) that diffusers stores as Linear (C, C)."""
    return _ATTN_WEIGHT.match(ldm_key) is not None


def _resnet(rest):
    return rest.replace("nin_shortcut", "conv_shortcut")


def ldm_to_diffusers_key(key, num_levels, old_attention=False):
    """The diffusers name of an LDM VAE key (num_levels = len(ch_mult), for the decoder's reversed indices)."""
    root, _, rest = key.partition(".")
    if root in ("quant_conv", "post_quant_conv"):
        return key
    if root not in ("encoder", "decoder"):
        raise KeyError(f"not a VAE key: {key!r}")
    if rest.startswith("norm_out."):
        return f"{root}.conv_norm_out.{rest[len('norm_out.'):]}"
    if rest.startswith(("conv_in.", "conv_out.")):
        return key
    m = re.match(r"^(down|up)\.(\d+)\.(block\.(\d+)|downsample|upsample)\.(.+)$", rest)
    if m:
        kind, i, what, j, tail = m.groups()
        blocks = "down_blocks" if kind == "down" else "up_blocks"
        i = int(i) if kind == "down" else num_levels - 1 - int(i)
        if j is not None:
            return f"{root}.{blocks}.{i}.resnets.{j}.{_resnet(tail)}"
        sampler = "downsamplers" if what == "downsample" else "upsamplers"
        return f"{root}.{blocks}.{i}.{sampler}.0.{tail}"
    m = re.match(r"^mid\.block_([12])\.(.+)$", rest)
    if m:
        return f"{root}.mid_block.resnets.{int(m.group(1)) - 1}.{_resnet(m.group(2))}"
    m = re.match(r"^mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)$", rest)
    if m:
        names = _ATTN_OLD if old_attention else _ATTN
        return f"{root}.mid_block.attentions.0.{names[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"no diffusers name for the VAE key {key!r}")


def find_prefix(keys):
    """The prefix under which a VAE sits in these keys ('first_stage_model.', 'vae.' or ''), or None."""
    keys = set(keys)
    for prefix in VAE_PREFIXES:
        if any(prefix + p in keys for p in PROBES):
            return prefix
    return None


def detect_layout(keys):
    """'diffusers' or 'ldm' from (prefix-stripped) key names; None when neither is recognisable."""
    diffusers = any(".down_blocks." in k or ".up_blocks." in k or ".mid_block." in k for k in keys)
    ldm = any(k.startswith(("encoder.down.", "decoder.up.", "encoder.mid.", "decoder.mid.")) for k in keys)
    if diffusers == ldm:
        return None
    return "diffusers" if diffusers else "ldm"


def has_old_attention(keys):
    return any(".mid_block.attentions.0.query." in k for k in keys)


# ----------------------------------------------------------------------------- what a non-VAE file looks like
def describe(keys):
    """A few words on what a file with these tensor names is, for errors ('a Flux transformer (BFL layout)')."""
    return CIO.describe_keys(keys)[1]
