"""The family registry (flame_models/registry.py): outside its folder a family is imported by no module of
flame_models (the registry imports it by name, when asked), no family imports another, and a new family is its
folder plus one registry line -- the trainer, file detection and describe_keys find it."""
import ast
import json
import os
import pathlib

import pytest

import flame_models
from flame_models import registry
from flame_models.training import family as training_family
from flame_models.training.model_files import describe_keys

ROOT = pathlib.Path(flame_models.__file__).parent


def _imports(path):
    """The flame_models modules a source file imports (relative imports resolved; `from . import x` as pkg.x)."""
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in out if m and m.startswith("flame_models")}


def test_only_the_registry_imports_a_family_and_no_family_imports_another():
    packages = dict(registry.FAMILIES)
    assert packages == {"flux": "flame_models.flux", "sd3": "flame_models.sd3", "sdxl": "flame_models.sdxl",
                        "flux_kontext": "flame_models.flux_kontext", "chroma": "flame_models.chroma",
                        "qwen_image": "flame_models.qwen_image"}
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        owner = next((name for name, pkg in packages.items() if path.is_relative_to(ROOT / pkg.split(".")[-1])), None)
        for target in _imports(path):
            for name, pkg in packages.items():
                if name != owner and (target == pkg or target.startswith(pkg + ".")):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert found == {}, found
    assert len(list((ROOT / "flux").glob("*.py"))) > 5                    # (the walk saw the families' files)


def test_every_family_is_found_through_the_registry():
    for name in registry.names():
        about = registry.about(name)
        assert about.name == name
        assert training_family.get_family(name).name == name
        files = registry.module(name, "generate").FILES    # its own class, or the shared Flux one (flame_models.bfl)
        assert files.__module__.startswith((registry.FAMILIES[name], "flame_models.bfl"))
        if about.key_marks:                                # (Kontext's files are Flux-dev's: no marks of its own)
            assert describe_keys(["model.diffusion_model." + about.key_marks[0]])[0] == about.header_kind
    assert registry.toolkit_flags() == {"is_flux": "flux", "is_v3": "sd3", "is_xl": "sdxl"}
    with pytest.raises(ValueError,
                       match="unknown model family 'sd2'; available: flux, sd3, sdxl, flux_kontext, chroma, "
                             "qwen_image"):
        registry.about("sd2")


TOY_ABOUT = '''
from flame_models.registry import About
from flame_models.vae import LatentFormat
ABOUT = About(name="toy", label="Toy", model_words="a Toy transformer", header_kind="toy",
              file_words="a Toy transformer", key_marks=("toy_blocks.0.qkv.weight",),
              pipeline_classes=("ToyPipeline",), latent_format=LatentFormat(0.5), trainer="ToyFamily")
'''
TOY_FAMILY = '''
from flame_models.training.family import ModelFamily
class ToyFamily(ModelFamily):
    name = "toy"
'''


def test_a_new_family_is_one_folder_and_one_registry_line(tmp_path, monkeypatch):
    pkg = tmp_path / "toy_family"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "about.py").write_text(TOY_ABOUT)
    (pkg / "family.py").write_text(TOY_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.FAMILIES, "toy", "toy_family")           # the one line
    monkeypatch.setattr(training_family, "_LOADED", {})
    assert registry.names()[-1] == "toy" and registry.latent_format("toy").scaling_factor == 0.5
    fam = training_family.get_family("toy")
    assert type(fam).__name__ == "ToyFamily" and "toy" in training_family.available_families()
    assert describe_keys(["toy_blocks.0.qkv.weight"]) == ("toy", "a Toy transformer", "toy_blocks.0.qkv.weight")
    folder = tmp_path / "toy-model"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
    assert registry.detect_family(folder) == ("toy", "a diffusers ToyPipeline folder")
    sd3 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sd3_pipeline", "pipeline")
    with pytest.raises(ValueError, match="is not a Toy transformer: it looks like a diffusers StableDiffusion3"):
        registry.detect_family(sd3, arch="toy")


def test_generate_refuses_another_familys_option_naming_whose_it_is():
    from flame_models import generate as G
    parts = {name: registry.module(name, "generate") for name in registry.names()}
    assert G._refusal("max_length", "sdxl", parts) == ("--max-length: a Flux / SD3 / Flux Kontext / Chroma / "
                                                       "Qwen-Image option; this model is SDXL")
    assert G._refusal("cfg", "flux", parts) == ("--cfg: an SD3 / SDXL / Chroma / Qwen-Image option; this model is "
                                                "Flux: its guidance is embedded (--guidance); true classifier-free "
                                                "guidance: --true-cfg")
    assert G._refusal("image", "chroma", parts) == "--image: a Flux Kontext option; this model is Chroma"
    assert G._refusal("guidance", "sd3", parts).startswith("--guidance: Flux's embedded guidance; this model is SD3")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['colour'\]"):
        G.generate("nowhere", "x", colour="red")
