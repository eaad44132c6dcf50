"""The README's demo and training entry: the same command as `python -m flame_models.train` (installed as
`flame-train`), runnable from a checkout without installing.

    python examples/train_flux_lora.py                      # the demo: everything tiny, built at run time, CPU < 60 s
    python examples/train_flux_lora.py --model FLUX.1-dev/ --data my_images/ --trigger ohwx --steps 2000
    python examples/train_flux_lora.py --help               # every flag with its default

The command itself (flags, demo, resume, exit codes) is flame_models/train.py.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flame_models.train import build_config, main, parser  # noqa: E402  (the command's parts, for callers)

__all__ = ["build_config", "main", "parser"]

if __name__ == "__main__":
    sys.exit(main())
