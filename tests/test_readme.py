"""The README's Python snippets run as written (on the cpu in CI, on the GPU with FLAME_DEVICE=cuda)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def snippets():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_has_snippets():
    assert len(snippets()) >= 3


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.gpu_exclusive)
                               if "max_gpu_memory" in code or "auto_fit" in code else i
                               for i, code in enumerate(snippets())])   # a budget snippet sizes from the free memory
def test_readme_snippet_runs(i, capsys):
    code = snippets()[i]
    exec(compile(code, f"README.md snippet {i}", "exec"), {"__name__": f"readme_snippet_{i}"})
    assert capsys.readouterr().out  # every snippet prints what it shows


def _training_commands(starts=(("-m", "flame_models.train"), ("examples/train_flux_lora.py",))):
    """The README's command lines that run one of `starts`: their arguments after the command."""
    import shlex
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    out = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for start in starts:
            for i in range(len(words) - len(start) + 1):
                if tuple(words[i:i + len(start)]) == start:
                    out.append(words[i + len(start):])
    return out


def test_the_readmes_training_commands_are_the_commands_and_take_its_flags():
    from flame_models import train
    commands = _training_commands()
    assert len(commands) >= 4 and any(c and c[0] == "--model" for c in commands)
    for args in commands:
        train.parser().parse_args(args)          # exits 2 on a flag the command does not have


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(os.path.dirname(README), "examples",
                                                                                "configs")) if f.endswith(".yaml")))
def test_a_shipped_config_unedited_names_the_paths_to_edit_and_exits_2(name, tmp_path, monkeypatch, capsys):
    """The README says the configs' paths are placeholders to edit: run as shipped, each names its missing model
    file or folder and data folder before loading anything."""
    from flame_models import train
    monkeypatch.chdir(tmp_path)
    assert train.main(["--config", os.path.join(os.path.dirname(README), "examples", "configs", name)]) == 2
    err = capsys.readouterr().err
    assert "model.name_or_path: no such file or folder" in err and "folder_path: no such folder" in err


def test_the_readme_states_what_the_samples_grid_and_a_run_without_model_are():
    with open(README, encoding="utf-8") as f:
        text = " ".join(f.read().split())
    assert "still to come" not in text                                   # the GPU figures are in BENCHMARKS.md
    assert "a first `data` column shows each caption's training image" in text
    assert "Without `--model`" in text and "tiny RANDOM one" in text and "`sd3.5-tiny` (`--arch sd3`)" in text
    assert "edit its paths to yours" in text
    # the SDXL LoRA sentence agrees with the text-encoder training above it (it said such files were refused)
    assert "refused for now" not in text and "SDXL also trains the text encoders' LoRA" in text
    assert "the trainer's transformer-only file and one with text-encoder parts both apply" in text


def test_the_readmes_generate_examples_read_the_lora_where_its_training_command_writes_it(monkeypatch):
    # before: the README generated with output/my_lora/my_lora.safetensors; the trainer writes runs/flux_lora/...
    from flame_models import train
    from flame_models.training import config as config_module
    monkeypatch.setattr(train, "config_from_dict", lambda d, src: config_module.config_from_dict(d, src, False))
    written = {}   # the model a README training command trains -> the LoRA it writes
    for args in _training_commands():
        a = train.parser().parse_args(args)
        if a.model and not a.config:
            cfg = train.build_config(a)[0]
            written[a.model] = os.path.join(cfg.output_dir, f"{cfg.name}.safetensors")
    checked = 0
    for args in _training_commands(starts=(("-m", "flame_models.generate"),)):
        model = args[args.index("--model") + 1]
        loras = [args[i + 1].rsplit(":", 1)[0] if re.search(r":[\d.]+$", args[i + 1]) else args[i + 1]
                 for i, w in enumerate(args) if w == "--lora"]
        if model in written:
            assert loras and all(p == os.path.relpath(written[model]) for p in loras), (loras, written[model])
            checked += 1
    assert written and checked >= 2
