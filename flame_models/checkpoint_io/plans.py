"""Conversion plans between a model's own checkpoint layout and diffusers': {own key: (diffusers keys, how,
sizes)}, where how is "copy" (one tensor, same values), "cat" (the own tensor is the diffusers tensors concatenated
along dim 0, e.g. qkv = to_q|to_k|to_v) or "swap" (the two halves of dim 0 trade places: adaLN (shift, scale) vs
(scale, shift)). Each family writes its plan (flux/keys.py, sd3/keys.py); the tensor work is here."""
import flame_core as flame


def combine(how, pieces):
    """The BFL tensor from its diffusers pieces (Tensors): one copied, several concatenated, or halves swapped."""
    if how == "copy":
        return pieces[0]
    if how == "cat":
        return flame.cat(list(pieces), dim=0)
    if how == "swap":
        (x,) = pieces
        n = x.shape[0] // 2
        return flame.cat([x[n:], x[:n]], dim=0)
    raise ValueError(f"unknown conversion {how!r}")


def separate(how, tensor, sizes):
    """The diffusers pieces of one BFL tensor (inverse of `combine`)."""
    if how == "copy":
        return [tensor]
    if how == "cat":
        out, start = [], 0
        for s in sizes:
            out.append(tensor[start:start + s])
            start += s
        return out
    if how == "swap":
        return [combine("swap", [tensor])]  # swapping halves is its own inverse
    raise ValueError(f"unknown conversion {how!r}")


def split_by_plan(state, plan):
    """A diffusers-layout state dict from one in the model's own layout (Tensors), by a diffusers plan ({own key:
    (diffusers keys, how, sizes)}, see diffusers_plan)."""
    out = {}
    for key, (dkeys, how, sizes) in plan.items():
        if key in state:
            out.update(zip(dkeys, separate(how, state[key], sizes)))
    return out


def join_by_plan(state, plan):
    """The model's own layout from a diffusers-layout state dict (Tensors): the inverse of split_by_plan."""
    out = {}
    for key, (dkeys, how, _) in plan.items():
        if all(k in state for k in dkeys):
            out[key] = combine(how, [state[k] for k in dkeys])
    return out
