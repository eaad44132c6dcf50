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


@pytest.mark.parametrize("i", range(len(snippets())))
def test_readme_snippet_runs(i, capsys):
    code = snippets()[i]
    exec(compile(code, f"README.md snippet {i}", "exec"), {"__name__": f"readme_snippet_{i}"})
    assert capsys.readouterr().out  # every snippet prints what it shows


def _training_commands():
    """The README's training command lines: their arguments after the command."""
    import shlex
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    out = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for start in (("-m", "flame_models.train"), ("examples/train_flux_lora.py",)):
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
