"""A worker for tests/distributed/test_trainer_ranks.py and test_gpu_ddp.py: the flux-tiny trainer run of
tests/training/conftest.py (synthetic data), started alone or by flame_core.distributed.run ("store" backend on the
cpu, "nccl" on cuda).

    python train_tiny.py OUT FOLDER NAME --steps S --batch B [--accum K] [--ckpt] [--device cuda --bf16] [--grads]
                         [--full [--optimizer adamw8bit]]

Writes OUT.rank<r>.npz: the adapter parameters after the run, the logged losses and the result's step count. With
--grads: no training; the gradients of the first micro-batch (averaged over the ranks) and its loss instead.
--bf16: bf16 base weights and bf16 autocast (the cuda default: CUDA graphs on). --full: a full fine-tune of the
same model instead of the LoRA (tests/training/test_full_finetune.py's config: every weight in float32).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from flame_models.training.trainer import Trainer  # noqa: E402
from tests.training.conftest import tiny_config  # noqa: E402
from tests.training.test_full_finetune import full_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("folder")
    ap.add_argument("name")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--grads", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--optimizer", default="adamw")
    a = ap.parse_args()
    from pathlib import Path
    train = {"batch_size": a.batch, "gradient_accumulation_steps": a.accum, "gradient_checkpointing": a.ckpt}
    top = {"device": a.device}
    if a.bf16:
        train["dtype"] = "bf16"
        top["model"] = {"dtype": "bf16"}
    if a.full:
        train.update(optimizer=a.optimizer, lr=1e-3, dtype=train.get("dtype", "fp32"))
        c = full_config(Path(a.folder), a.name, steps=a.steps, dtype="bf16" if a.bf16 else "fp32", train=train,
                        **({"device": a.device}))
    else:
        c = tiny_config(Path(a.folder), a.name, steps=a.steps, train=train, **top)
    c.save.save_every = 3
    tr = Trainer(c, verbose=False, handle_signals=False)
    out = {"world": tr.dist.world_size}
    if a.grads:
        tr.setup()
        tr.stop = tr.dist.before_step(tr.model, tr.stop, tr.named_adapter_parameters)
        loss, ts = tr._micro_step(tr.loader.next_batch(), 1.0, graph=False)
        loss, _ = tr.dist.reduce_step(tr.stop, loss, ts)
        out["losses"] = np.asarray([loss])
        out.update({"g/" + k: p.grad.float().numpy() for k, p in tr.named_adapter_parameters()})
    else:
        result = tr.train()
        out["losses"] = np.asarray(result["losses"], dtype=np.float64)
        out["steps"] = result["steps"]
    out.update({"p/" + k: p.detach().float().numpy() for k, p in tr.named_adapter_parameters()})
    if tr.graphed is not None:   # CUDA graphs: how many shapes were captured, and why a capture failed
        out["graphs_captured"] = tr.graphed.captured
        out["graph_failure"] = str(tr.graphed.failure or "")
    np.savez(f"{a.out}.rank{tr.dist.rank}.npz", **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
