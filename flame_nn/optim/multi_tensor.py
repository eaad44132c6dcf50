"""What the optimizers' one-launch GPU paths share (kernels: flame_core.kernels.optim_multi): which parameters a
multi-tensor kernel can take, and the kernel tables of an optimizer's parameter sets."""
import numpy as np

from flame_core import as_tensor, backend

from .optimizer import grads_of, state_on_device

try:
    from flame_core.kernels import loader as _loader
    from flame_core.kernels import optim_multi as kernels
except ImportError:  # fused kernels not in this build
    kernels = None

_GRAD_DTYPES = ("float32", "float16", "bfloat16")


def enabled():
    """Whether the multi-tensor kernels can run at all (built, and kernels not switched off)."""
    return kernels is not None and _loader.enabled()


def fusable(a, g, param_dtypes=("float32",)):
    """Whether a parameter array `a` (float32, or one of `param_dtypes` where the kernel takes more) with gradient
    array `g` can take a multi-tensor kernel."""
    return (backend.is_cuda_array(a) and a.dtype.name in param_dtypes and a.flags.c_contiguous
            and backend.is_cuda_array(g)
            and g.flags.c_contiguous and g.size == a.size and g.dtype.name in _GRAD_DTYPES)


def usable(s, size):
    """Whether `s` is a contiguous float32 GPU array of `size` elements (a kernel row's state)."""
    return (s is not None and backend.is_cuda_array(s) and s.dtype == np.float32 and s.size == size
            and s.flags.c_contiguous)


class Tables:
    """The kernel tables of an optimizer's parameter sets, cached by the addresses of the parameters and states (the
    same every step); the gradients are re-pointed at each use (a lazy gradient pool moves them)."""

    def __init__(self, keep=8):
        self.keep, self.tables = keep, {}

    def get(self, rows, make=None):
        """The table of `rows` (param, grad, *states): made by `make(rows)` (default kernels.optim_table) the first
        time, its gradients re-pointed after."""
        key = tuple((a.data.ptr, a.size) if a is not None else None for row in rows for a in row[:1] + row[2:])
        table = self.tables.get(key)
        if table is None:
            if len(self.tables) >= self.keep:
                self.tables.pop(next(iter(self.tables)))
            table = self.tables[key] = (make or kernels.optim_table)(rows)
        else:
            table.set_grads([row[1] for row in rows])
        return table


def table_of(opt, rows, make=None):
    """The kernel table of `rows` for optimizer `opt` (its Tables, kept on it)."""
    return opt.__dict__.setdefault("_tables", Tables()).get(rows, make)


def keep_tables(opt, n):
    """Let optimizer `opt` keep at least `n` kernel tables: a layer-wise update steps each block's parameters on their
    own, one table (per step-count bucket) a block, and a block's parameters and states sit at the same addresses
    every step (a streamed block's in its home slot), so each table is built once instead of once per step."""
    tables = opt.__dict__.setdefault("_tables", Tables())
    tables.keep = max(tables.keep, int(n))
    return tables


def tables_kept(opt):
    """How many kernel tables `opt` keeps (Tables' default unless keep_tables raised it): optimizers with a table
    cache of their own (AdamW8bit's plans) bound it by this too."""
    tables = opt.__dict__.get("_tables")
    return tables.keep if tables is not None else Tables().keep


def stepped(params):
    """After a kernel updated `params` in place: their versions bumped; the set of their ids (what the
    per-operation path then skips)."""
    for p in params:
        p._version[0] += 1
    return {id(p) for p in params}


def gather(opt, group, keys, init):
    """(rows (param, grad, *states), params) of `group`'s parameters a kernel can take: fusable, with the state
    entries `keys` usable (a parameter without state gets init(array) -> {key: array} first); the others are left
    to the per-operation path."""
    rows, params = [], []
    for p, g in grads_of(group):
        a = p.array
        if not fusable(a, g):
            continue
        st = opt.state.get(p)
        if st is None:
            st = opt.state[p] = {k: as_tensor(v) for k, v in init(a).items()}
        st = state_on_device(st, p)
        states = [st[k].array for k in keys]
        if all(usable(s, a.size) for s in states):
            rows.append((a, g, *states))
            params.append(p)
    return rows, params
