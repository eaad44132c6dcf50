"""L-BFGS (Nocedal 1980; PyTorch's, after minFunc): each step(closure) runs up to max_iter iterations of

    d = -H g   (two-loop recursion over the last history_size pairs s = t d, y = g' - g with y.s > 1e-10,
                initial H = y.s / y.y; the very first direction is -g)
    x += t d   (t = lr, the very first t = min(1, 1 / |g|_1) lr; or t from a strong-Wolfe line search)
stopping as PyTorch: max_iter, max_eval evaluations, max |g| <= tolerance_grad, g.d > -tolerance_change, max |t d|
or the loss change below tolerance_change. One parameter group; the state (history, last direction and step) is
kept on the first parameter, as PyTorch. The closure re-evaluates the loss and its gradients and returns the loss.
"""
import numpy as np

from flame_core import as_tensor, backend

from .optimizer import Optimizer, _closure_loss


def _scalar(a):
    """A reduction's 0-d result as a host scalar of its dtype: arithmetic with Python floats then stays in that dtype
    (float32 for float32 parameters), as with PyTorch's 0-d tensors."""
    return a.dtype.type(float(a))


def _cubic_min(x1, f1, g1, x2, f2, g2, bounds=None):
    """Minimiser of the cubic through (x1, f1) and (x2, f2) with slopes g1, g2, clamped to `bounds` (default: the two
    points); the bounds' midpoint when the cubic has no minimum."""
    lo, hi = bounds if bounds is not None else (min(x1, x2), max(x1, x2))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    disc = d1 ** 2 - g1 * g2
    if disc < 0:
        return (lo + hi) / 2.0
    d2 = np.sqrt(disc)
    if x1 > x2:  # the formula takes x2 as the right point
        x1, f1, g1, x2, f2, g2 = x2, f2, g2, x1, f1, g1
    with np.errstate(divide="ignore", invalid="ignore"):  # a flat cubic gives inf / nan, as PyTorch's 0-d tensors
        x = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
    return min(max(x, lo), hi)


def strong_wolfe(evaluate, t, d, f, g, gtd, c1=1e-4, c2=0.9, tolerance_change=1e-9, max_ls=25):
    """Line search along d for a step t meeting the strong Wolfe conditions (sufficient decrease c1, curvature c2):
    bracket a step by cubic extrapolation, then zoom into the bracket by safeguarded cubic interpolation.
    `evaluate(t)` -> (loss, flat gradient) at x + t d; f, g, gtd: loss, gradient and slope g.d at x.
    Returns (loss, gradient, t, evaluations) of the best point found."""
    d_norm = _scalar(abs(d).max())
    points = None   # bracket: [(t, loss, gradient, slope)], one point when it already meets the conditions
    prev = (0.0, f, g, gtd)
    f_new, g_new = evaluate(t)
    gtd_new, evals, it = _scalar(g_new @ d), 1, 0
    while it < max_ls:
        if f_new > f + c1 * t * gtd or (it > 1 and f_new >= prev[1]):
            points = [prev, (t, f_new, g_new, gtd_new)]
            break
        if abs(gtd_new) <= -c2 * gtd:
            points = [(t, f_new, g_new, gtd_new)]
            break
        if gtd_new >= 0:
            points = [prev, (t, f_new, g_new, gtd_new)]
            break
        t_next = _cubic_min(prev[0], prev[1], prev[3], t, f_new, gtd_new, bounds=(t + 0.01 * (t - prev[0]), t * 10))
        prev = (t, f_new, g_new, gtd_new)
        t = t_next
        f_new, g_new = evaluate(t)
        gtd_new, evals, it = _scalar(g_new @ d), evals + 1, it + 1
    if points is None:  # out of evaluations while extrapolating
        points = [(0.0, f, g, None), (t, f_new, g_new, None)]
    done = len(points) == 1
    low, high = (0, 1) if points[0][1] <= points[-1][1] else (1, 0)
    insufficient = False
    while not done and it < max_ls:
        (ta, fa, _, sa), (tb, fb, _, sb) = points
        if abs(tb - ta) * d_norm < tolerance_change:
            break
        t = _cubic_min(ta, fa, sa, tb, fb, sb)
        left, right = min(ta, tb), max(ta, tb)
        margin = 0.1 * (right - left)
        if min(right - t, t - left) < margin:  # too close to an end: step 10% in, unless just progressing
            if insufficient or t >= right or t <= left:
                t = right - margin if abs(t - right) < abs(t - left) else left + margin
                insufficient = False
            else:
                insufficient = True
        else:
            insufficient = False
        f_new, g_new = evaluate(t)
        gtd_new, evals, it = _scalar(g_new @ d), evals + 1, it + 1
        new = (t, f_new, g_new, gtd_new)
        if f_new > f + c1 * t * gtd or f_new >= points[low][1]:
            points[high] = new
            low, high = (0, 1) if points[0][1] <= points[1][1] else (1, 0)
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (points[high][0] - points[low][0]) >= 0:
                points[high] = points[low]
            points[low] = new
    t, f_new, g_new, _ = points[low]
    return f_new, g_new, t, evals


class LBFGS(Optimizer):
    per_parameter = False  # (see Optimizer.per_parameter)
    def __init__(self, params, lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7, tolerance_change=1e-9,
                 history_size=100, line_search_fn=None):
        if lr < 0:
            raise ValueError(f"LBFGS: invalid lr={lr} (must be >= 0)")
        for k, v in (("max_iter", max_iter), ("history_size", history_size)):
            if v < 1:
                raise ValueError(f"LBFGS: invalid {k}={v} (must be >= 1)")
        if line_search_fn not in (None, "strong_wolfe"):
            raise ValueError(f"LBFGS: invalid line_search_fn={line_search_fn!r} (None or 'strong_wolfe')")
        max_eval = max_iter * 5 // 4 if max_eval is None else max_eval
        super().__init__(params, dict(lr=lr, max_iter=max_iter, max_eval=max_eval, tolerance_grad=tolerance_grad,
                                      tolerance_change=tolerance_change, history_size=history_size,
                                      line_search_fn=line_search_fn))
        self._params = self.param_groups[0]["params"]

    def add_param_group(self, group):
        if self.param_groups:
            raise ValueError("LBFGS doesn't support per-parameter options (parameter groups): give it one group")
        super().add_param_group(group)

    def _cast_state(self, p, key, v):
        # the history lists are copied item by item: a loaded optimizer shares nothing with the state it came from
        return [self._cast_state(p, key, x) for x in v] if isinstance(v, list) else super()._cast_state(p, key, v)

    def _flat_grad(self):
        xp = backend.xp_of(self._params[0].array)
        return xp.concatenate([(xp.zeros(p.array.size, p.array.dtype) if p.grad is None else p.grad.array.ravel())
                               for p in self._params])

    def _move(self, t, d):
        """x += t d, d a flat vector over the parameters."""
        at = 0
        for p in self._params:
            w = p.array
            w += (t * d[at:at + w.size]).reshape(w.shape).astype(w.dtype, copy=False)
            at += w.size
            p._version[0] += 1

    def _evaluate(self, closure):
        """(loss, flat gradient) from the closure at the current parameters."""
        return float(_closure_loss(closure)), self._flat_grad()  # the loss a host float, as PyTorch

    def _line_evaluate(self, closure, x, t, d):
        """_evaluate at x + t d (x: the parameters' arrays), the parameters left at x."""
        self._move(t, d)
        out = self._evaluate(closure)
        for p, a in zip(self._params, x):
            p.array[...] = a
            p._version[0] += 1
        return out

    def step(self, closure):
        if closure is None:
            raise TypeError("LBFGS.step needs a closure that re-evaluates the loss (zero_grad, forward, backward) "
                            "and returns it")
        group = self.param_groups[0]
        lr, max_iter, max_eval, history = group["lr"], group["max_iter"], group["max_eval"], group["history_size"]
        tol_grad, tol_change = group["tolerance_grad"], group["tolerance_change"]
        st = self.state.setdefault(self._params[0], {"func_evals": 0, "n_iter": 0})
        orig_loss = _closure_loss(closure)
        loss, g = float(orig_loss), self._flat_grad()
        evals = 1
        st["func_evals"] += 1
        if _scalar(abs(g).max()) <= tol_grad:
            return orig_loss
        d, prev_g = (None if st.get(k) is None else st[k].array for k in ("d", "prev_flat_grad"))
        t, h_diag = st.get("t"), st.get("H_diag")
        dirs, stps = [v.array for v in st.get("old_dirs", [])], [v.array for v in st.get("old_stps", [])]
        ro, prev_loss = list(st.get("ro", [])), st.get("prev_loss")
        for n in range(1, max_iter + 1):
            st["n_iter"] += 1
            if st["n_iter"] == 1:
                d, dirs, stps, ro, h_diag = -g, [], [], [], 1.0
            else:
                y, s = g - prev_g, d * t
                ys = _scalar(y @ s)
                if ys > 1e-10:  # curvature pair kept (the oldest dropped when the history is full)
                    if len(dirs) == history:
                        del dirs[0], stps[0], ro[0]
                    dirs.append(y)
                    stps.append(s)
                    ro.append(1.0 / ys)
                    h_diag = ys / _scalar(y @ y)
                d = self._two_loop(-g, dirs, stps, ro, h_diag)
            prev_g, prev_loss = g, loss
            t = (min(1.0, 1.0 / _scalar(abs(g).sum())) if st["n_iter"] == 1 else 1.0) * lr
            gtd = _scalar(g @ d)
            if gtd > -tol_change:  # not a descent direction any more
                break
            used, opt_cond = 0, False
            if group["line_search_fn"] == "strong_wolfe":
                x0 = [p.array.copy() for p in self._params]
                loss, g, t, used = strong_wolfe(lambda step: self._line_evaluate(closure, x0, step, d), t, d, loss, g,
                                                gtd, max_ls=max_eval - evals)
                self._move(t, d)
                opt_cond = _scalar(abs(g).max()) <= tol_grad
            else:
                self._move(t, d)
                if n != max_iter:  # the last iteration's loss is left for the next step to evaluate
                    (loss, g), used = self._evaluate(closure), 1
                    opt_cond = _scalar(abs(g).max()) <= tol_grad
            evals += used
            st["func_evals"] += used
            if n == max_iter or evals >= max_eval or opt_cond or _scalar(abs(d * t).max()) <= tol_change or \
                    abs(loss - prev_loss) < tol_change:
                break
        st.update(d=as_tensor(d), t=t, old_dirs=[as_tensor(v) for v in dirs], old_stps=[as_tensor(v) for v in stps],
                  ro=ro, H_diag=h_diag, prev_flat_grad=as_tensor(prev_g), prev_loss=prev_loss)
        return orig_loss

    @staticmethod
    def _two_loop(q, dirs, stps, ro, h_diag):
        """The L-BFGS inverse-Hessian approximation times q (q, a new array, is consumed)."""
        al = [0.0] * len(dirs)
        for i in reversed(range(len(dirs))):
            al[i] = _scalar(stps[i] @ q) * ro[i]
            q -= al[i] * dirs[i]
        r = q * h_diag
        for i in range(len(dirs)):
            r += (al[i] - _scalar(dirs[i] @ r) * ro[i]) * stps[i]
        return r
