"""NumPy's keyword names where PyTorch accepts them. PyTorch's argument parser lets every function it binds from
C++ take `axis` for `dim` and `keepdims` for `keepdim` (python_arg_parser's numpy_compatibility_arg_names); the
functions it writes in Python (torch.norm / Tensor.norm, torch.split / Tensor.split, Tensor.unflatten,
torch.nn.functional.softmax, ...) take neither. FLAME's functions of the first kind are listed here; the others keep
PyTorch's names only."""
import functools

# FLAME functions whose PyTorch counterparts (torch.X and Tensor.X alike) are C++-bound with a dim/keepdim argument
NAMES = ("sum", "mean", "var", "std", "var_mean", "max", "min", "amax", "amin", "argmax", "argmin", "prod",
         "logsumexp", "all", "any", "cumsum", "cumprod", "softmax", "log_softmax", "count_nonzero",
         "squeeze", "unsqueeze", "chunk", "tensor_split", "unbind", "narrow", "select", "repeat_interleave",
         "cat", "concat", "concatenate", "stack", "gather", "scatter_add", "index_select", "sort", "argsort", "topk",
         "scatter", "scatter_reduce", "index_add", "median", "nanmedian", "kthvalue", "cummax", "cummin", "nansum",
         "nanmean", "aminmax")
_ALIASES = (("axis", "dim"), ("keepdims", "keepdim"))
_wrapped = {}


def _rename(kwargs, op):
    for alias, name in _ALIASES:
        if alias in kwargs:
            if name in kwargs:
                raise TypeError(f"{op}() got both {name!r} and its NumPy alias {alias!r}")
            kwargs[name] = kwargs.pop(alias)


def with_numpy_names(fn):
    """`fn` also taking axis= / keepdims= (one wrapper per function, shared by flame.X and Tensor.X)."""
    w = _wrapped.get(fn)
    if w is None:
        @functools.wraps(fn)
        def w(*args, **kwargs):
            if kwargs:
                _rename(kwargs, fn.__name__)
            return fn(*args, **kwargs)
        _wrapped[fn] = w
    return w
