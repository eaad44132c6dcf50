"""erfc and the normal CDF on NumPy arrays (NumPy has no erf; a per-element math.erf costs ~130 ns an element): a
fitted approximation for the CPU paths of float32 / float16 / bfloat16 tensors (float64 tensors keep math.erfc /
math.erf: exact to the last bit).

erfc(z) = t exp(S(t) - z^2), t = 1 / (1 + z / 2), for 0 <= z <= ZMAX; S is a polynomial in t (mapped onto [-1, 1])
fitted by tools/fit_erfc.py (Chebyshev interpolation of log(erfc(z) / t) + z^2, math.erfc as the truth).
`erfc` (the erfc op) evaluates the degree-12 fit in float64: relative error below 2.6e-10 on [0, ZMAX], a few
thousandths of a float32 ulp; beyond ZMAX erfc < 2.1e-45, zero in float32. `normal_cdf32` (exact GELU) takes Phi(x)
= 0.5 erfc(-x / sqrt(2)) from the degree-9 fit in float32 with the exponent in float64, so both tails keep their
relative accuracy (the 1 + erf(x) form loses every digit of the lower tail)."""
import math

import numpy as np

ZMAX = 10.0
# made by `python tools/fit_erfc.py --degree 12`: S's power series in u = (t - TMIN) * 2 / (1 - TMIN) - 1
TMIN = 0.16666666666666666
POLY = (-0.5585953511338155, 0.5703071538583213, 0.01574488733635014, -0.029471354425827705, -0.001043373597013845,
        0.003713174859596072, -0.00028525384709101784, -0.0005473444418087453, 0.00014778811860878638,
        6.78837379124333e-05, -3.8783346538293935e-05, -4.7357165874960085e-06, 5.308855481404639e-06)
# made by `python tools/fit_erfc.py --degree 9` (relative error 5.1e-8 on [0, ZMAX] in float64 arithmetic, below half a
# float32 ulp): the same form for float32 arithmetic (normal_cdf32), ln(1/2) added to its constant term there
POLY32 = (-0.5585954009622095, 0.5703071436763879, 0.015747387658053075, -0.029470883972789935,
          -0.0010638115607937424, 0.003709455976024766, -0.0002253227837240246, -0.0005369681794113567,
          7.240968887103349e-05, 5.603968198641951e-05)
_U_SCALE = 2.0 / (1.0 - TMIN)
_U_SHIFT = -TMIN * _U_SCALE - 1.0
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_POLY32_HALF = (POLY32[0] + math.log(0.5),) + POLY32[1:]   # t exp(S - z^2) / 2 = erfc(z) / 2


def erfc_nonneg(z):
    """erfc of a float64 array z >= 0 (NaN stays NaN), as a new float64 array."""
    zc = np.minimum(z, ZMAX)
    t = 0.5 * zc
    t += 1.0
    np.reciprocal(t, out=t)
    u = t * _U_SCALE
    u += _U_SHIFT
    s = np.full_like(u, POLY[-1])   # Horner's rule
    for c in POLY[-2::-1]:
        s *= u
        s += c
    s -= zc * zc
    np.exp(s, out=s)
    s *= t
    s[z > ZMAX] = 0.0
    return s


def erfc(x):
    """erfc of a float64 array of any sign: erfc(-z) = 2 - erfc(z)."""
    e = erfc_nonneg(np.abs(x))
    return np.where(x < 0, 2.0 - e, e)


def normal_cdf32(x):
    """Phi(x) of a float32 array as a new float32 array: the lower tail q = Phi(-|x|) = erfc(|x| / sqrt(2)) / 2 from
    the degree-9 form (POLY32) with t and the polynomial in float32 and the exponent S - x^2 / 2 and its exp in
    float64 (in float32 that sum's rounding alone is ~x^2 6e-8 relative: 100 ulp at x = -13); the upper tail 1 - q,
    selected arithmetically (q + [x >= 0] (1 - 2q): NumPy's where / masked copy are ~40x slower than a pass here).
    A few float32 roundings from Phi in both tails. Past z = ZMAX the polynomial runs on past its fitted interval
    (u < -1, where it stays within a few tenths of S(-1)) while e^-z^2 underflows: Phi(-inf) = 0, Phi(inf) = 1."""
    z = np.abs(x, out=np.empty(x.shape, np.float32))   # (out= arrays throughout: a 0-d x stays an array)
    z *= np.float32(_INV_SQRT2)
    t = np.multiply(z, np.float32(0.5), out=np.empty_like(z))
    t += 1
    np.reciprocal(t, out=t)
    u = np.multiply(t, np.float32(_U_SCALE), out=z)
    u += np.float32(_U_SHIFT)
    p = _POLY32_HALF
    s = np.multiply(u, np.float32(p[-1]), out=np.empty_like(u))   # Horner's rule
    s += np.float32(p[-2])
    for c in p[-3::-1]:
        s *= u
        s += np.float32(c)
    e = s.astype(np.float64)
    x2 = x.astype(np.float64)
    x2 *= x2
    x2 *= 0.5
    e -= x2
    np.exp(e, out=e)
    e *= t
    np.copyto(s, e, casting="same_kind")
    q = s                                        # Phi(-|x|), rounded once to float32
    w = np.multiply(q, np.float32(-2.0), out=t)
    w += 1                                       # 1 - 2q (exact for q >= 1/4, one rounding below)
    w *= x >= 0
    w += q                                       # q, or (1 - 2q) + q = 1 - q
    return w
