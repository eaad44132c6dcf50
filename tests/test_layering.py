"""The layers above flame_core use its public surface only: a tensor's array through `Tensor.array` /
`Tensor.set_array_` (never `._data`), and no private name of flame_core (`from flame_core.x import _y`, a private
module, or `module._name` on something imported from flame_core). Checked on the source, by its syntax tree."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABOVE_CORE = ("flame_nn", "flame_models", "examples")  # bench measures kernels and may reach inside


def _python_files(package):
    for folder, _, names in os.walk(os.path.join(ROOT, package)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def private_uses(source, filename="<source>"):
    """[(line, what)] of every private use of flame_core in `source`."""
    tree = ast.parse(source, filename)
    found, bound = [], set()  # bound: local names of flame_core modules and objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "flame_core":
                    bound.add(alias.asname or parts[0])
                    if any(p.startswith("_") for p in parts):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flame_core":
            if any(p.startswith("_") for p in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import"))
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "_data":
            found.append((node.lineno, "._data"))
        elif (isinstance(node.value, ast.Name) and node.value.id in bound and node.attr.startswith("_")
              and not node.attr.startswith("__")):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(found)


@pytest.mark.parametrize("package", ABOVE_CORE)
def test_the_layers_above_the_core_use_its_public_surface(package):
    bad = []
    for path in _python_files(package):
        with open(path, encoding="utf-8") as f:
            bad += [f"{os.path.relpath(path, ROOT)}:{line}: {what}" for line, what in private_uses(f.read(), path)]
    assert not bad, "private flame_core uses (use Tensor.array / set_array_, as_tensor, public names):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("source, what", [
    ("w = p._data\n", "._data"),
    ("st['m']._data[...] = 0\n", "._data"),
    ("from flame_core.tensor import _wrap\n", "from flame_core.tensor import _wrap"),
    ("from flame_core.checkpoint import CheckpointFunction, _dummy\n", "from flame_core.checkpoint import _dummy"),
    ("from flame_core import _private\n", "from flame_core import _private"),
    ("import flame_core._secret as s\n", "import flame_core._secret"),
    ("from flame_core.ops import conv as C\nC._is_pointwise(g)\n", "C._is_pointwise"),
    ("import flame_core as flame\nflame._hidden\n", "flame._hidden"),
])
def test_the_scan_finds_each_kind_of_private_use(source, what):
    assert what in [w for _, w in private_uses(source)]


def test_the_scan_leaves_public_and_own_names_alone():
    source = ("import flame_core as flame\nfrom flame_core import as_tensor\nfrom flame_core.amp import autocast_mode "
              "as _amp\nx = p.array\nself._dataset = d\n_amp.active\nflame.__version__\n")
    assert private_uses(source) == []
