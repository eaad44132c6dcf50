"""A worker for tests/distributed/test_trainer_ranks.py: the image-folder trainer run of tests/training (tiny Flux
folder, drawn images in two aspect buckets, latents and text cached, decoded previews), alone or under
flame_core.distributed.run.

    python train_images.py OUT FOLDER NAME MODEL IMAGES --steps S --batch B

Writes OUT.rank<r>.npz: the adapter parameters, the logged losses, and what this rank encoded itself.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from flame_models.training.trainer import Trainer  # noqa: E402
from flame_nn import adapters as A  # noqa: E402
from tests.training.conftest import image_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for name in ("out", "folder", "name", "model", "images"):
        ap.add_argument(name)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    from pathlib import Path
    c = image_config(Path(a.folder), a.name, a.model, a.images, steps=a.steps, train={"batch_size": a.batch},
                     sample={"sample_every": 2, "sample_steps": 2, "prompts": ["[trigger] on a blue background"]},
                     datasets=[{"folder_path": a.images, "resolution": 64, "bucket_tolerance": 32,
                                "cache_latents_to_disk": True}])  # caches on disk: rank 0 fills, rank 1 reads
    tr = Trainer(c, verbose=False, handle_signals=False)
    result = tr.train()
    mine = tr.prepared.encoded
    np.savez(f"{a.out}.rank{tr.dist.rank}.npz", losses=np.asarray(result["losses"], dtype=np.float64),
             encoded_latents=mine["latents"], encoded_text=mine["text"], decodes=tr.prepared.decode is not None,
             buckets=sorted({str(b) for b in tr.dataset.buckets()}),
             **{"p/" + k: p.detach().numpy() for k, p in A.named_adapter_parameters(tr.model)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
