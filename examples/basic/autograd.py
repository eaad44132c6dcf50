"""Train a small MLP on a synthetic regression task with flame_core autograd and manual SGD.

Run: python examples/basic/autograd.py   (uses the GPU when CuPy sees one; FLAME_DEVICE=cpu forces the CPU)
"""
import math

import flame_core as flame


def main(steps=400, lr=0.02, seed=0):
    flame.manual_seed(seed)
    dev = flame.default_device()
    # data: y = sin(3 x0) + x1 * x2, a target an MLP can learn
    x = flame.randn(512, 3, device=dev)
    y = ((x[:, 0] * 3).sin() + x[:, 1] * x[:, 2]).unsqueeze(1)

    def init(fan_in, fan_out):
        bound = 1 / math.sqrt(fan_in)
        w = (flame.rand(fan_in, fan_out, device=dev) * 2 - 1) * bound
        b = (flame.rand(fan_out, device=dev) * 2 - 1) * bound
        return w.requires_grad_(), b.requires_grad_()

    params = [*init(3, 64), *init(64, 64), *init(64, 1)]
    w1, b1, w2, b2, w3, b3 = params
    first = None
    for step in range(steps):
        h = (x @ w1 + b1).tanh()
        h = (h @ w2 + b2).tanh()
        pred = h @ w3 + b3
        loss = ((pred - y) ** 2).mean()
        for p in params:
            p.grad = None
        loss.backward()
        with flame.no_grad():
            for p in params:
                p -= lr * p.grad
        if first is None:
            first = loss.item()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    print(f"loss fell from {first:.4f} to {loss.item():.4f} on {dev}")
    return first, loss.item()


if __name__ == "__main__":
    main()
