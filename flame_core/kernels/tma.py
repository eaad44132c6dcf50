"""TMA tensor maps (CUtensorMap: 128 opaque bytes) for sm_90 kernels: encoded on the host by the driver
(cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col of libcuda, through ctypes) and passed by value as a kernel's
`const __grid_constant__` parameter (launching.launch accepts a TensorMap among the arguments). A map holds the
tensor's address, so it is encoded per call; encoding is a host computation of a few microseconds, and a CUDA graph
captures the parameter's bytes with the launch.

    tiled_2d(a, box_rows, box_cols)        rows x cols boxes of a 2-D row-major array (128-byte swizzle)
    TiledMap(dtype, dims, strides, box, out, slot)
                                           a map of fixed shape and strides re-encoded for each call's address
    im2col_nhwc(a, N, H, W, C, ...)        the im2col boxes of an (N, H, W, C) activation for an implicit-GEMM conv
    pack(maps, count)                      several maps as one parameter (a struct of `count` maps)
    ZERO, ZERO4                            all-zero parameters: those of an instantiation that reads none
"""
import ctypes

import numpy as np

MAP_BYTES = 128
_SWIZZLE_128B = 3           # CU_TENSOR_MAP_SWIZZLE_128B: chunk c of row r at c ^ (r % 8), 1024-byte aligned tiles
_L2_PROMOTION_128B = 2      # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
_DTYPES = {"float16": 6, "bfloat16": 9, "float32": 7}  # CUtensorMapDataType


class TensorMap:
    """`count` maps of 128 bytes back to back, 64-byte aligned (the driver's requirement) in host memory: `address` is
    what a kernel launch copies into the parameter (a CUtensorMap, or a struct of `count` of them)."""
    __slots__ = ("_buf", "address", "count")

    def __init__(self, count=1):
        self.count = count
        self._buf = ctypes.create_string_buffer(MAP_BYTES * count + 64)
        self.address = (ctypes.addressof(self._buf) + 63) & ~63


def pack(maps, count):
    """One parameter of `count` maps: `maps` in order, the rest zero."""
    if len(maps) > count:
        raise ValueError(f"tma.pack: {len(maps)} maps into a parameter of {count}")
    out = TensorMap(count)
    for i, m in enumerate(maps):
        ctypes.memmove(out.address + i * MAP_BYTES, m.address, MAP_BYTES)
    return out


ZERO = TensorMap()
ZERO4 = TensorMap(4)

_lib = []


def available():
    """Whether the driver encodes tensor maps (libcuda with cuTensorMapEncodeTiled / Im2col: CUDA 12 drivers on)."""
    try:
        _driver()
        return True
    except (OSError, AttributeError):
        return False


def _driver():
    if not _lib:
        lib = ctypes.CDLL("libcuda.so.1")
        u64p, u32p, i32p = (ctypes.POINTER(t) for t in (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int))
        tiled = lib.cuTensorMapEncodeTiled
        tiled.restype = ctypes.c_int
        tiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                          ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        im2col = lib.cuTensorMapEncodeIm2col
        im2col.restype = ctypes.c_int
        im2col.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, i32p, i32p,
                           ctypes.c_uint32, ctypes.c_uint32, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int]
        _lib.append((tiled, im2col))
    return _lib[0]


def _arr(ctype, values):
    return (ctype * len(values))(*values)


def _dtype(a):
    return _dtype_code(a.dtype)


def _dtype_code(dtype):
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise TypeError(f"tma: no tensor map data type for {name} (float16, bfloat16, float32)")
    return _DTYPES[name]


def _check(err, what):
    if err:
        raise RuntimeError(f"tma: {what} failed (CUresult {err})")


def tiled_2d(a, box_rows, box_cols):
    """Boxes of box_rows x box_cols elements of the row-major 2-D array `a` (rows, cols), stored in shared memory as
    rows of box_cols elements with the 128-byte swizzle (box_cols * itemsize must be 128); rows or columns past the
    array are zero-filled."""
    rows, cols = a.shape
    if box_cols * a.itemsize != 128 or not 1 <= box_rows <= 256 or a.strides[1] != a.itemsize \
            or a.strides[0] % 16 or a.data.ptr % 16:
        raise ValueError(f"tma.tiled_2d: box {box_rows}x{box_cols} of a {a.shape} array with strides {a.strides}: "
                         f"needs 128-byte box rows, at most 256 of them, and 16-byte aligned rows")
    m = TensorMap()
    TiledMap(a.dtype, [cols, rows], [a.strides[0]], (box_cols, box_rows), m).encode(a.data.ptr)
    return m


def im2col_nhwc(a, N, H, W, C, lower, upper, strides, channels, pixels):
    """The im2col map of activation `a` (N, H, W, C contiguous, channel-last) for a convolution: a load at tensor
    coordinates (c, w, h, n) and filter offsets (kw*dw, kh*dh) fetches `pixels` rows of `channels` channels from c
    on - the input pixels (w, h) + offsets of consecutive output pixels, walking the bounding box of tap-(0, 0)
    positions (w from lower[0] to W - 1 + upper[0] in steps of strides[0], then h, then n) - stored as rows of
    `channels` elements with the 128-byte swizzle; pixels outside the image are zero-filled (the padding).
    lower / upper / strides are (w, h)."""
    if channels * a.itemsize != 128 or not 1 <= pixels <= 256 or C % 8 or a.size != N * H * W * C \
            or a.data.ptr % 16:
        raise ValueError(f"tma.im2col_nhwc: {channels} channels x {pixels} pixels of a ({N}, {H}, {W}, {C}) "
                         f"activation: needs 128-byte rows, at most 256 pixels, C a multiple of 8, 16-byte alignment")
    if not all(-128 <= v <= 127 for v in tuple(lower) + tuple(upper)):
        raise ValueError(f"tma.im2col_nhwc: bounding box corners {lower} / {upper} outside [-128, 127] (4-D maps)")
    e = a.itemsize
    m = TensorMap()
    _check(_driver()[1](m.address, _dtype(a), 4, a.data.ptr, _arr(ctypes.c_uint64, [C, W, H, N]),
                        _arr(ctypes.c_uint64, [C * e, W * C * e, H * W * C * e]),
                        _arr(ctypes.c_int, list(lower)), _arr(ctypes.c_int, list(upper)), channels, pixels,
                        _arr(ctypes.c_uint32, [1, strides[0], strides[1], 1]), 0, _SWIZZLE_128B,
                        _L2_PROMOTION_128B, 0),
           f"cuTensorMapEncodeIm2col of a ({N}, {H}, {W}, {C}) activation, box corners {lower} / {upper}, strides "
           f"{strides}, {channels} channels x {pixels} pixels")
    return m


class TiledMap:
    """A tiled map (128-byte swizzle) of fixed dtype, shape, strides and box whose array changes from call to call:
    `encode(ptr)` writes the map of the array at device address `ptr` into map `slot` of `out` (a TensorMap, e.g. the
    parameter a PackedLaunch passes), skipping the driver when `ptr` is the address encoded last. dims: elements per
    dimension, innermost first (that one contiguous); strides: bytes of the outer dimensions; box: elements per
    dimension (box[0] * itemsize = 128). Raises ValueError for what TMA cannot describe (checked here, before any
    encoding): strides not multiples of 16 or from 2**40 on, dims of 0 or over 2**32, boxes over 256."""
    __slots__ = ("_args", "_dst", "_ptr", "_what")

    def __init__(self, dtype, dims, strides, box, out, slot=0):
        dims, strides, box = [int(v) for v in dims], [int(v) for v in strides], [int(v) for v in box]
        itemsize = np.dtype(dtype).itemsize
        self._what = f"a tiled map of dims {dims}, strides {strides} bytes, box {box}"
        if not 1 <= len(dims) <= 5 or len(box) != len(dims) or len(strides) != len(dims) - 1:
            raise ValueError(f"tma.TiledMap: {self._what}: ranks disagree (1 to 5 dims)")
        if box[0] * itemsize != 128 or not all(1 <= b <= 256 for b in box):
            raise ValueError(f"tma.TiledMap: {self._what}: needs 128-byte box rows and at most 256 per box dim")
        if not all(1 <= d <= 2 ** 32 for d in dims) or not all(0 < st < 2 ** 40 and st % 16 == 0 for st in strides):
            raise ValueError(f"tma.TiledMap: {self._what}: strides must be positive multiples of 16 below 2**40")
        if not 0 <= slot < out.count:
            raise ValueError(f"tma.TiledMap: slot {slot} of a parameter of {out.count} maps")
        self._args = (_dtype_code(dtype), len(dims), _arr(ctypes.c_uint64, dims), _arr(ctypes.c_uint64, strides),
                      _arr(ctypes.c_uint32, box), _arr(ctypes.c_uint32, [1] * len(dims)))
        self._dst = out.address + slot * MAP_BYTES
        self._ptr = None

    def encode(self, ptr):
        if ptr == self._ptr:
            return
        if ptr % 16:
            raise ValueError(f"tma.TiledMap: {self._what}: address {ptr:#x} is not 16-byte aligned")
        t, rank, dims, strides, box, ones = self._args
        self._ptr = None
        _check(_driver()[0](self._dst, t, rank, ptr, dims, strides, box, ones, 0, _SWIZZLE_128B, _L2_PROMOTION_128B,
                            0), f"cuTensorMapEncodeTiled of {self._what}")
        self._ptr = ptr
