"""End to end: an MLP and a small CNN train to a target loss on synthetic data."""
import numpy as np

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F


def test_mlp_regression_reaches_target(device):
    flame.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (256, 2)).astype(np.float32)
    y = (np.sin(3 * x[:, :1]) + x[:, 1:] ** 2).astype(np.float32)
    X, Y = flame.tensor(x, device=device), flame.tensor(y, device=device)
    model = nn.Sequential(nn.Linear(2, 64), nn.SiLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    opt = nn.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    sched = nn.optim.lr_scheduler.get_cosine_schedule_with_warmup(opt, 20, 200)
    first = None
    for _ in range(200):
        loss = F.mse_loss(model(X), Y)
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    final = float(F.mse_loss(model(X), Y))
    assert first > 0.3 and final < 5e-3, (first, final)


def _bars(rng, n):
    """8x8 images of a horizontal (0), vertical (1) or diagonal (2) bar at a random place, plus noise."""
    imgs = rng.normal(0, 0.3, (n, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, n)
    for i, c in enumerate(labels):
        k = rng.integers(1, 7)
        if c == 0:
            imgs[i, 0, k, :] += 1.5
        elif c == 1:
            imgs[i, 0, :, k] += 1.5
        else:
            imgs[i, 0][np.eye(8, k=int(k) - 4, dtype=bool)] += 1.5
    return imgs, labels


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.drop(self.features(x)))


def test_small_cnn_classifier_reaches_target(device):
    flame.manual_seed(1)
    rng = np.random.default_rng(1)
    x, t = _bars(rng, 192)
    xv, tv = _bars(rng, 96)
    X, T = flame.tensor(x, device=device), flame.tensor(t, device=device)
    model = SmallCNN().to(device)
    opt = nn.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(40):
        loss = F.cross_entropy(model(X), T)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with flame.no_grad():
        logits = model(flame.tensor(xv, device=device))
        val_loss = float(F.cross_entropy(logits, flame.tensor(tv, device=device)))
        acc = float((logits.argmax(1).numpy() == tv).mean())
    assert val_loss < 0.25 and acc >= 0.95, (val_loss, acc)
