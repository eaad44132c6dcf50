"""Module.state_dict / load_state_dict hooks and extra state (flame_nn/state_dict_hooks.py), with PyTorch's
signatures and order: pre-hooks before a module's entries, post-hooks after its children's, load pre-hooks parent
first with each module's prefix, load post-hooks that may clear the reported keys before the strict check."""
import pytest

import flame_core as flame
import flame_nn as nn
from flame_nn.module import StateDictError


class Counter(nn.Module):
    """A module with extra state (a Python int) beside a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = 0

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


def net():
    return nn.Sequential(nn.Linear(2, 3), Counter())


def test_state_dict_hooks_run_in_order_and_may_change_the_dict():
    m = net()
    seen = []
    m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: seen.append(("pre", prefix, keep_vars)))
    m[1].register_state_dict_pre_hook(lambda mod, prefix, keep_vars: seen.append(("pre", prefix, keep_vars)))

    def post(mod, sd, prefix, meta):
        seen.append(("post", prefix, sorted(sd)))
        sd[prefix + "note"] = flame.tensor(1.0)
    m[1].register_state_dict_post_hook(post)
    sd = m.state_dict(keep_vars=True)
    assert seen[0] == ("pre", "", True) and seen[1] == ("pre", "1.", True)
    assert seen[2] == ("post", "1.", ["0.bias", "0.weight", "1._extra_state", "1.lin.bias", "1.lin.weight"])
    assert list(sd) == ["0.weight", "0.bias", "1._extra_state", "1.lin.weight", "1.lin.bias", "1.note"]
    m[1].register_state_dict_post_hook(lambda *a: {})
    with pytest.raises(RuntimeError, match="must return None"):
        m.state_dict()


def test_private_post_hook_replaces_the_dict_and_handles_remove():
    m = net()
    h = m._register_state_dict_hook(lambda mod, sd, prefix, meta: {k: v for k, v in sd.items() if "bias" not in k})
    assert not any("bias" in k for k in m.state_dict())
    h.remove()
    assert "0.bias" in m.state_dict()


def test_load_pre_hooks_rename_keys_with_their_prefix():
    src = net()
    sd = dict(src.state_dict())
    old = {k.replace("1.lin.", "1.old_lin."): v for k, v in sd.items()}      # an older checkpoint's names
    dst = net()

    def rename(mod, state, prefix, meta, strict, missing, unexpected, errors):
        for k in [k for k in state if k.startswith(prefix + "old_lin.")]:
            state[k.replace("old_lin.", "lin.")] = state.pop(k)
    dst[1].register_load_state_dict_pre_hook(rename)
    dst.load_state_dict(old)
    assert (dst[1].lin.weight.detach().numpy() == src[1].lin.weight.detach().numpy()).all()
    assert "1.old_lin.weight" in old          # the caller's dict is left as it was


def test_private_load_pre_hook_without_the_module_and_error_messages():
    m = net()
    calls = []
    m._register_load_state_dict_pre_hook(lambda state, prefix, *rest: calls.append(prefix))
    m.load_state_dict(m.state_dict())
    assert calls == [""]
    m.register_load_state_dict_pre_hook(lambda mod, state, prefix, meta, strict, missing, unexpected, errors:
                                        errors.append("this checkpoint is too old"))
    before = m[0].weight.detach().numpy().copy()
    sd = {k: (v * 0 if hasattr(v, "shape") else v) for k, v in m.state_dict().items()}
    with pytest.raises(StateDictError, match="this checkpoint is too old"):
        m.load_state_dict(sd)
    assert (m[0].weight.detach().numpy() == before).all()   # nothing copied


def test_load_post_hooks_may_clear_missing_keys_before_the_strict_check():
    m = net()
    sd = m.state_dict()
    del sd["0.bias"]
    with pytest.raises(StateDictError, match=r"0\.bias"):
        m.load_state_dict(sd)
    seen = []

    def forgive(mod, keys):
        seen.append(list(keys.missing_keys))
        keys.missing_keys.clear()
    m.register_load_state_dict_post_hook(forgive)
    result = m.load_state_dict(sd)
    assert seen == [["0.bias"]] and result.missing_keys == []
    m.register_load_state_dict_post_hook(lambda mod, keys: keys)
    with pytest.raises(RuntimeError, match="must return None"):
        m.load_state_dict(sd)


def test_extra_state_round_trip_and_missing():
    m = net()
    m[1].calls = 7
    sd = m.state_dict()
    assert sd["1._extra_state"] == {"calls": 7}
    fresh = net()
    fresh.load_state_dict(sd)
    assert fresh[1].calls == 7
    del sd["1._extra_state"]
    with pytest.raises(StateDictError, match="_extra_state"):
        fresh.load_state_dict(sd)
    assert fresh.load_state_dict(sd, strict=False).missing_keys == ["1._extra_state"]


def test_state_dict_positional_arguments_warn():
    m = nn.Linear(2, 2)
    with pytest.warns(FutureWarning, match="Positional args"):
        sd = m.state_dict(None, "model.")
    assert list(sd) == ["model.weight", "model.bias"]


def test_parametrized_weight_norm_loads_the_older_hook_forms_keys():
    from flame_nn.utils import parametrizations as P
    from flame_nn.utils import weight_norm as hook_weight_norm
    old = hook_weight_norm(nn.Linear(3, 2))          # weight_g / weight_v keys
    sd = old.state_dict()
    assert {"weight_g", "weight_v"} <= set(sd)
    new = P.weight_norm(nn.Linear(3, 2))
    new.load_state_dict(sd)
    x = flame.randn(4, 3)
    assert (abs(new(x) - old(x)).max().item()) < 1e-6
