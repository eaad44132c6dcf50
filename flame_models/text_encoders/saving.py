"""save_pretrained: a text encoder as a transformers folder (config.json + model.safetensors) that load_clip /
load_t5 and transformers both read. The config also goes into the safetensors metadata, so the file alone still
describes a model whose config the weights cannot tell (a tiny CLIP's heads and activation)."""
import json
import os

from flame_core.io import save_file

from .. import checkpoint_io as CIO

CONFIG_METADATA_KEY = "flame.text_encoder_config"


def save_pretrained(model, folder, dtype=None):
    """Write `model` (CLIPTextModel[WithProjection] or T5EncoderModel) to `folder`; returns the file paths. dtype:
    the floating weights written in it (None: their own). Models with fp8-stored Linear weights are refused
    (transformers has no such layout)."""
    from flame_nn.offload import is_fp8_linear
    fp8 = [n for n, m in model.named_modules() if is_fp8_linear(m)]
    if fp8:
        raise ValueError(f"save_pretrained: {len(fp8)} Linear layers store fp8 weights (e.g. {fp8[0]}); "
                         f"transformers cannot read them: load the model without quantize to save it")
    if getattr(model, "streamer", None) is not None:
        raise ValueError("save_pretrained: the blocks are streamed; close the streamer first "
                         "(model.streamer.close())")
    config = _transformers_config(model)
    if dtype is not None:
        config["dtype"] = str(dtype).replace("flame.", "")
    os.makedirs(folder, exist_ok=True)
    weights = os.path.join(folder, "model.safetensors")
    save_file({k: CIO.cast_item(v, dtype) for k, v in model.state_dict().items()}, weights,
              metadata={"format": "pt", CONFIG_METADATA_KEY: json.dumps(model.config.to_dict())})
    path = CIO.write_json(os.path.join(folder, "config.json"), config, sort_keys=True)
    return [path, weights]


def _transformers_config(model):
    c = dict(model.config.to_dict())
    dtype = str(model.dtype).replace("flame.", "")
    if type(model).__name__ == "T5EncoderModel":
        c.update(model_type="t5", is_gated_act=True, dense_act_fn="gelu_new", is_encoder_decoder=False,
                 use_cache=False, dropout_rate=0.0)
    else:
        c.update(model_type="clip_text_model", attention_dropout=0.0)
    c.update(architectures=[type(model).__name__], dtype=dtype)
    return c
