"""A worker for tests/distributed/test_trainer_ranks.py: the flux-tiny trainer run of tests/training/conftest.py
(cpu, fp32, synthetic data), started alone or by flame_core.distributed.run (then on the "store" backend).

    python train_tiny.py OUT FOLDER NAME --steps S --batch B [--accum K] [--ckpt]

Writes OUT.rank<r>.npz: the adapter parameters after the run, the logged losses and the result's step count.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from flame_nn import adapters as A  # noqa: E402
from flame_models.training.trainer import Trainer  # noqa: E402
from tests.training.conftest import tiny_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("folder")
    ap.add_argument("name")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--ckpt", action="store_true")
    a = ap.parse_args()
    from pathlib import Path
    c = tiny_config(Path(a.folder), a.name, steps=a.steps,
                    train={"batch_size": a.batch, "gradient_accumulation_steps": a.accum,
                           "gradient_checkpointing": a.ckpt})
    c.save.save_every = 3
    tr = Trainer(c, verbose=False, handle_signals=False)
    result = tr.train()
    params = {k: p.detach().numpy() for k, p in A.named_adapter_parameters(tr.model)}
    np.savez(f"{a.out}.rank{tr.dist.rank}.npz", losses=np.asarray(result["losses"], dtype=np.float64),
             steps=result["steps"], world=tr.dist.world_size, **{"p/" + k: v for k, v in params.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
