"""The config's network (`network:`: LoRA, LoHa, LoKr, LoCon; its rank, alpha, targets and filters) put on the frozen
model as adapters, after checking that they fit their layers and the device (limits.adapter_problems).

    n = add_network(model, cfg.network, family, name_map, seed=cfg.train.seed, device=dev, budget=None,
                    optimizer="adamw")        # how many modules got an adapter

LoCon (kohya's conv_dim): the linear targets plus what comes with the convolutions (the family's
conv_linear_targets) at the linear rank, then the convolutions left at the conv rank (alpha: conv_alpha, else conv).
Each group's initial values come from its own seeded generator (seed + 3, seed + 4): a run's adapters are the same
whatever else draws random numbers.
"""
import flame_core as flame
from flame_nn import adapters as A

from .config import ConfigError
from .limits import adapter_problems


def add_network(model, network, family, name_map, *, seed, device, budget, optimizer):
    """Inject `network` (config.NetworkConfig) into `model` of `family`; ConfigError before any adapter is made when
    the rank exceeds a targeted layer or the adapters would not fit `device` under `budget` (bytes or None) with
    `optimizer`'s state. Returns how many modules were adapted."""
    n = network
    targets = family.target_presets.get(n.target, n.target) if isinstance(n.target, str) else n.target
    filters = dict(only_if_contains=n.network_kwargs.get("only_if_contains"),
                   ignore_if_contains=n.network_kwargs.get("ignore_if_contains"))

    def check(found, rank, kind, setting):
        problems = adapter_problems(found, rank, kind, setting, device, budget, optimizer)
        if problems:
            raise ConfigError("; ".join(problems))

    if n.conv:
        targets = ([targets] if isinstance(targets, str) else list(targets)) + list(family.conv_linear_targets)
    check(A.find_targets(model, targets, name_map, **filters), n.linear, n.type, "network.linear")
    made = A.inject_adapters(model, targets, "lora" if n.type == "locon" else n.type, rank=n.linear,
                             alpha=n.linear_alpha, dropout=n.dropout, rslora=n.rslora, lokr_factor=n.lokr_factor,
                             lokr_full_rank=n.lokr_full_rank, name_map=name_map, **filters,
                             generator=flame.Generator("cpu").manual_seed(seed + 3))
    if n.conv:
        done = {m for m, _ in made}
        convs = [m for m, _, _ in A.find_targets(model, family.conv_targets, name_map, **filters) if m not in done]
        if convs:
            check([(m, model.get_submodule(m), None) for m in convs], n.conv, "lora", "network.conv")
            made += A.inject_adapters(model, convs, "lora", rank=n.conv,
                                      alpha=n.conv if n.conv_alpha is None else n.conv_alpha, dropout=n.dropout,
                                      rslora=n.rslora, name_map=name_map,
                                      generator=flame.Generator("cpu").manual_seed(seed + 4))
    return len(made)
