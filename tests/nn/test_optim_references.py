"""Prodigy, Adafactor, Lion and schedule-free AdamW step by step against their reference implementations
(prodigyopt, transformers, lion-pytorch, schedulefree): tests/fixtures/optimizers/*.safetensors, written by
tests/fixtures/make_optimizer_fixtures.py where torch is installed. Same initial values, same gradients each step,
float32 and float64; Prodigy's D estimate and schedule-free's eval() point too."""
import json
import os
import struct

import numpy as np
import pytest

import flame_nn as nn
from flame_core import io
from flame_nn.optim import Adafactor, AdamWScheduleFree, Lion, Prodigy

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "optimizers")
CLASSES = {"prodigy": Prodigy, "adafactor": Adafactor, "lion": Lion, "adamw_schedulefree": AdamWScheduleFree}
TOL = {"float32": dict(rtol=2e-5, atol=2e-6), "float64": dict(rtol=1e-10, atol=1e-12)}


def _metadata(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))["__metadata__"]


def _kwargs(case):
    return {k: tuple(v) if isinstance(v, list) else v for k, v in case.items()}


def _cases(name):
    path = os.path.join(FIX, f"{name}.safetensors")
    meta = _metadata(path)
    return io.load_file(path), json.loads(meta["cases"]), int(meta["steps"])


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_the_reference_step_by_step(name, dtype):
    data, cases, steps = _cases(name)
    assert cases and steps >= 3
    for c, case in enumerate(cases):
        pre = f"{c}.{dtype}"
        n = sum(1 for k in data if k.startswith(pre + ".p") and k.endswith(".init"))
        params = [nn.Parameter(data[f"{pre}.p{i}.init"].clone()) for i in range(n)]
        assert params and all(dtype in str(p.dtype) for p in params)
        opt = CLASSES[name](params, **_kwargs(case))
        if name == "adamw_schedulefree":
            opt.train()
        for t in range(1, steps + 1):
            for i, p in enumerate(params):
                p.grad = data[f"{pre}.p{i}.grad{t}"].clone()
            opt.step()
            for i, p in enumerate(params):
                np.testing.assert_allclose(p.detach().numpy(), data[f"{pre}.p{i}.step{t}"].numpy(), **TOL[dtype],
                                           err_msg=f"{name} case {c} {case} {dtype}: parameter {i} after step {t}")
            if name == "prodigy":
                assert opt.param_groups[0]["d"] == pytest.approx(float(data[f"{pre}.d{t}"].numpy()[0]),
                                                                 rel=TOL[dtype]["rtol"] * 10), (case, t)
        if name == "adamw_schedulefree":
            opt.eval()
            for i, p in enumerate(params):
                np.testing.assert_allclose(p.detach().numpy(), data[f"{pre}.p{i}.eval"].numpy(), **TOL[dtype],
                                           err_msg=f"{name} case {c} {dtype}: parameter {i} after eval()")


def test_fixtures_are_small():
    sizes = {n: os.path.getsize(os.path.join(FIX, f"{n}.safetensors")) for n in CLASSES}
    assert sum(sizes.values()) < 1 << 20, sizes
