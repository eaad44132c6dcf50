"""The config's network (`network:`: LoRA, LoHa, LoKr, LoCon; its rank, alpha, targets and filters) put on the frozen
model as adapters, after checking that they fit their layers and the device (limits.adapter_problems).

    n = add_network(model, cfg.network, family, name_map, seed=cfg.train.seed, device=dev, budget=None,
                    optimizer="adamw")        # how many modules got an adapter

LoCon (kohya's conv_dim): the linear targets plus what comes with the convolutions (the family's
conv_linear_targets) at the linear rank, then the convolutions left at the conv rank (alpha: conv_alpha, else conv).
Each group's initial values come from its own seeded generator (seed + 3, seed + 4): a run's adapters are the same
whatever else draws random numbers. With network.pretrained_lora_path the file's adapters come first, from its
values (pretrained_lora.py).
"""
import numpy as np

import flame_core as flame
from flame_nn import adapters as A

from .config import ConfigError
from .limits import adapter_fit_problem, adapter_problems
from .pretrained_lora import SETTING


def add_network(model, network, family, name_map, *, seed, device, budget, optimizer, pretrained=None):
    """Inject `network` (config.NetworkConfig) into `model` of `family`; ConfigError before any adapter is made when
    the rank exceeds a targeted layer or the adapters would not fit `device` under `budget` (bytes or None) with
    `optimizer`'s state. pretrained: a pretrained_lora.PretrainedLoRA whose adapters go on first, from its values;
    then only the layers it lacks of network.target / network.conv when those were given (its fresh_linear /
    fresh_conv). Returns how many modules were adapted."""
    n = network
    targets = family.target_presets.get(n.target, n.target) if isinstance(n.target, str) else n.target
    filters = dict(only_if_contains=n.network_kwargs.get("only_if_contains"),
                   ignore_if_contains=n.network_kwargs.get("ignore_if_contains"))

    def check(found, rank, kind, setting):
        problems = adapter_problems(found, rank, kind, setting, device, budget, optimizer)
        if problems:
            raise ConfigError("; ".join(problems))

    def unadapted(found):
        return [f for f in found if not A.has_adapter(f[1])]

    made = []
    if pretrained is not None:
        count = sum(int(np.size(t)) for parts in pretrained.denoiser.values() for p in parts
                    for t in p.tensors.values())
        problem = adapter_fit_problem(count, len(pretrained.denoiser), f"{SETTING} {pretrained.path}", device,
                                      budget, optimizer)
        if problem:
            raise ConfigError(problem)
        made = A.inject_from_state(model, pretrained.denoiser, dropout=n.dropout, rslora=n.rslora, **dropouts(n))
    kind = "lora" if n.type == "locon" else n.type
    if n.conv:
        targets = ([targets] if isinstance(targets, str) else list(targets)) + list(family.conv_linear_targets)
    if pretrained is None or pretrained.fresh_linear:
        found = A.find_targets(model, targets, name_map, **filters)
        found = found if pretrained is None else unadapted(found)  # (none found: inject_adapters says so)
        if found or pretrained is None:
            check(found, n.linear, n.type, "network.linear")
            made += A.inject_adapters(model, targets, kind, rank=n.linear, alpha=n.linear_alpha, dropout=n.dropout,
                                      rslora=n.rslora, lokr_factor=n.lokr_factor, lokr_full_rank=n.lokr_full_rank,
                                      name_map=name_map, **filters, skip_adapted=pretrained is not None,
                                      generator=flame.Generator("cpu").manual_seed(seed + 3), **dropouts(n))
    if n.conv and (pretrained is None or pretrained.fresh_conv):
        convs = [m for m, mod, _ in unadapted(A.find_targets(model, family.conv_targets, name_map, **filters))]
        if convs:
            check([(m, model.get_submodule(m), None) for m in convs], n.conv, "lora", "network.conv")
            made += A.inject_adapters(model, convs, "lora", rank=n.conv,
                                      alpha=n.conv if n.conv_alpha is None else n.conv_alpha, dropout=n.dropout,
                                      rslora=n.rslora, name_map=name_map,
                                      generator=flame.Generator("cpu").manual_seed(seed + 4), **dropouts(n))
    return len(made)


def dropouts(network):
    """kohya's rank_dropout / module_dropout of the network, as inject_adapters takes them."""
    return dict(rank_dropout=network.rank_dropout, module_dropout=network.module_dropout)
