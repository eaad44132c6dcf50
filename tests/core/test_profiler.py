"""flame_core.profiler: per-op rows for forward and backward, nesting counted once, originals restored."""
import flame_core as flame
from flame_core import profiler
from flame_core.autograd import Function


class Twice(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2          # a nested op: counted under Twice, not Mul

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_rows_per_op_and_phase(device):
    x = flame.randn(8, 8, device=device, requires_grad=True)
    fwd_before = Twice.__dict__["forward"]
    with profiler.profile() as prof:
        y = Twice.apply(x).tanh().sum()
        y.backward()
    agg = prof.key_averages()
    assert agg[("Twice", "fwd")][0] == 1 and agg[("Twice", "bwd")][0] == 1
    assert ("Mul", "fwd") not in agg and not any(k[0].startswith("Mul") for k in agg)  # nested op folded in
    assert any(k[1] == "bwd" and "anh" in k[0] for k in agg)
    assert all(row[1] >= 0 for row in agg.values())
    assert Twice.__dict__["forward"] is fwd_before  # restored
    table = prof.table()
    assert "Twice" in table and "region wall time" in table
    assert prof.wall_s > 0
    # outside the block nothing is recorded
    Twice.apply(x)
    assert len(prof.records) == sum(r[0] for r in agg.values())


def test_saved_tensors_report_counts_each_storage_once(device):
    x = flame.randn(16, 32, device=device, requires_grad=True)
    w = flame.randn(32, 32, device=device, requires_grad=True)
    h = x @ w                       # saves x (and w, excluded)
    y = (h.gelu() @ w)[:, :8]       # gelu saves h; the matmul saves gelu's output
    total, rows = profiler.saved_tensors_report(y.sum(), exclude=[w])
    by_op = {name: (b, n) for name, b, n in rows}
    item = x.element_size()
    assert total == 3 * 16 * 32 * item
    assert by_op["GeluBackward"] == (16 * 32 * item, 1)
    assert by_op["MatmulBackward"] == (2 * 16 * 32 * item, 2)
