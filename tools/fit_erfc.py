"""Fits the erfc approximation of flame_core/kernels/erfc_fit.py (the NumPy paths' erfc; NumPy has none) and prints
its coefficients and measured error:

    python tools/fit_erfc.py [--degree 14]

Form: erfc(z) = t exp(S(t) - z^2) for z in [0, ZMAX], t = 1 / (1 + z / 2): S(t) = log(erfc(z) / t) + z^2 is smooth on
t in [1 / (1 + ZMAX / 2), 1]; S is interpolated at Chebyshev points of that interval (math.erfc as the truth) and kept
as a Chebyshev series in u, t mapped onto [-1, 1], and printed as the power series in u it equals (evaluated by
Horner's rule: two array operations per degree). The error of that form is measured against math.erfc on a dense
grid."""
import argparse
import math

import numpy as np
from numpy.polynomial import chebyshev as C

ZMAX = 10.0


def fit(degree):
    tmin = 1.0 / (1.0 + 0.5 * ZMAX)

    def s_of_u(u):
        t = tmin + (u + 1.0) * (1.0 - tmin) / 2.0
        z = (1.0 / t - 1.0) * 2.0
        return np.array([math.log(math.erfc(v)) for v in z]) - np.log(t) + z * z

    return tmin, C.chebinterpolate(s_of_u, degree)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--degree", type=int, default=12)
    args = ap.parse_args()
    tmin, c = fit(args.degree)
    print(f"TMIN = {tmin!r}")
    poly = C.cheb2poly(c)
    print("POLY = (" + ", ".join(repr(float(v)) for v in poly) + ")")
    z = np.linspace(0.0, ZMAX, 400001)
    t = 1.0 / (1.0 + 0.5 * z)
    u = (t - tmin) * (2.0 / (1.0 - tmin)) - 1.0
    s = np.full_like(u, poly[-1])
    for k in poly[-2::-1]:
        s = s * u + k
    got = t * np.exp(s - z * z)
    ref = np.array([math.erfc(v) for v in z])
    print(f"max relative error on [0, {ZMAX}]: {float(np.max(np.abs(got - ref) / ref)):.3g}")


if __name__ == "__main__":
    main()
