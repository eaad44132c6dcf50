"""The SDXL pipeline fixture (tests/fixtures/sdxl_pipeline: FLAME's SAI file of diffusers' tiny parts, made by
make_sdxl_pipeline_fixtures.py) loaded as SDXLParts, for the tests that write it out as a diffusers folder or an SAI
file (test_generate_sd.py, test_generate_img2img.py, training/test_sd_families.py)."""
import json
import os

import flame_core as flame

SDXL_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sdxl_pipeline")


def sdxl_tiny_parts():
    """The fixture's SDXLParts (float32, cpu), its configs from the fixture's meta.json."""
    from flame_models.sdxl import UNetConfig, load_sdxl
    from flame_models.vae import VAEConfig
    with open(os.path.join(SDXL_FIXTURE, "meta.json")) as f:
        c = json.load(f)["configs"]
    configs = {"unet": UNetConfig.from_diffusers_config(c["unet"]),
               "vae": VAEConfig.from_diffusers_config(c["vae"]).to_dict(), "clip_l": c["text_encoder"],
               "clip_g": c["text_encoder_2"]}
    return load_sdxl(os.path.join(SDXL_FIXTURE, "sdxl_tiny.safetensors"), tokenizer=SDXL_FIXTURE, configs=configs,
                     dtype=flame.float32, device="cpu")


def sdxl_tiny_folder(folder):
    """The fixture written as a diffusers folder at `folder`; returns its path."""
    from flame_models.sdxl import save_sdxl
    save_sdxl(sdxl_tiny_parts(), str(folder), layout="diffusers")
    return str(folder)
