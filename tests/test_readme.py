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
