"""Random numbers: `manual_seed` and `Generator` objects. Same seed, same device -> same numbers."""
import numpy as np

from . import backend
from .device import device as _parse_device


class Generator:
    """A random stream bound to a device (NumPy PCG64 on cpu, CuPy's generator on cuda)."""

    def __init__(self, device="cpu"):
        self.device = _parse_device(device)
        self._seed = None
        self.manual_seed(np.random.SeedSequence().entropy % (2 ** 63))

    def manual_seed(self, seed):
        self._seed = int(seed) % (2 ** 64)
        if self.device.type == "cuda":
            self._rng = _CudaPhilox(self._seed)
        else:
            self._rng = np.random.Generator(np.random.PCG64(self._seed))
        return self

    def seed(self):
        s = int(np.random.SeedSequence().entropy % (2 ** 63))
        self.manual_seed(s)
        return s

    def initial_seed(self):
        return self._seed

    def get_state(self):
        """Exact stream position (for checkpoint resume and checkpoint RNG replay)."""
        if self.device.type == "cuda":
            return {"device": str(self.device), "seed": self._seed, "offset": self._rng.offset}
        return {"device": "cpu", "seed": self._seed, "state": self._rng.bit_generator.state}

    def set_state(self, state):
        self.manual_seed(state["seed"])
        if self.device.type == "cuda":
            self._rng.offset = int(state["offset"])
        else:
            self._rng.bit_generator.state = state["state"]

    # array-level draws (float32 or wider; callers cast)
    def _normal(self, shape, np_dtype):
        dt = np_dtype if np_dtype in (np.float32, np.float64) else np.float32
        return self._rng.standard_normal(shape, dtype=dt)

    def _uniform(self, shape, np_dtype):
        dt = np_dtype if np_dtype in (np.float32, np.float64) else np.float32
        return self._rng.random(shape, dtype=dt)

    def _integers(self, low, high, shape):
        return self._rng.integers(low, high, size=shape, dtype=np.int64)


class _CudaPhilox:
    """GPU draws from cuda_src/philox.cu: counter-based, so the state is (seed, offset) and restoring it replays
    exactly the same numbers."""

    _module = None

    def __init__(self, seed):
        self.seed = seed
        self.offset = 0

    @classmethod
    def _fn(cls, name):
        if cls._module is None:
            from .kernels import loader
            cls._module = loader.load_module("philox")
        return cls._module.get_function(name)

    def reserve(self, n):
        """The offset at which a draw of n numbers starts; the stream advances past them (by ceil(n / 4) * 4: offsets
        stay multiples of 4, each kernel thread consumes one counter). Refused while a CUDA graph is captured."""
        s = backend.cupy.cuda.get_current_stream()
        if s.ptr and s.is_capturing():
            from .cuda.graphs import GraphCaptureError
            raise GraphCaptureError("random numbers drawn while capturing a CUDA graph would be the same on every "
                                    "replay (the seed and offset are baked into the graph): draw them outside the "
                                    "captured region and pass them in")
        offset = self.offset
        self.offset += 4 * ((n + 3) // 4)
        return offset

    def _launch(self, name, out, *extra):
        cp = backend.cupy
        n = out.size
        offset = self.reserve(n)
        threads = (n + 3) // 4
        if threads:
            self._fn(name)(((threads + 255) // 256,), (256,),
                           (out, cp.int64(n), cp.uint64(self.seed), cp.uint64(offset)) + extra)
        return out

    def standard_normal(self, shape, dtype):
        cp = backend.cupy
        out = cp.empty(shape, dtype=dtype)
        return self._launch("philox_fill_f64" if dtype == np.float64 else "philox_fill_f32", out, cp.int32(1))

    def random(self, shape, dtype):
        cp = backend.cupy
        out = cp.empty(shape, dtype=dtype)
        return self._launch("philox_fill_f64" if dtype == np.float64 else "philox_fill_f32", out, cp.int32(0))

    def integers(self, low, high, size, dtype=np.int64):
        cp = backend.cupy
        out = cp.empty(size, dtype=np.int64)
        return self._launch("philox_integers", out, cp.int64(low), cp.uint64(high - low))

    def permutation(self, n):
        keys = self.random((n,), np.float32)
        return backend.cupy.argsort(keys)


_defaults = {}


def default_generator(device):
    device = _parse_device(device)
    g = _defaults.get(device)
    if g is None:
        g = _defaults[device] = Generator(device)
        if _initial_seed is not None:
            g.manual_seed(_initial_seed)
    return g


_initial_seed = None


def manual_seed(seed):
    """Seed the default generators of every device (present and future)."""
    global _initial_seed
    _initial_seed = int(seed)
    for g in _defaults.values():
        g.manual_seed(seed)
    return default_generator("cpu")


def seed():
    s = int(np.random.SeedSequence().entropy % (2 ** 63))
    manual_seed(s)
    return s


def get_rng_state(device="cpu"):
    return default_generator(device).get_state()


def set_rng_state(state, device="cpu"):
    default_generator(device).set_state(state)
