"""TransformerDecoderLayer, TransformerDecoder and Transformer against PyTorch (golden fixtures,
tests/fixtures/make_transformer_decoder_fixtures.py): PyTorch's state_dicts load as they are (the same submodule
names), and the outputs and input gradients match in float64 with causal / additive masks and key padding masks;
plus the Transformer's argument checks and its causal mask helper."""
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "transformer_decoder.safetensors")

CASES = {
    "dec_post": lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0),
    "dec_pre": lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                                  norm_first=True),
    "decoder": lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0), 2,
                                             norm=nn.LayerNorm(8)),
    "transformer": lambda: nn.Transformer(8, 2, 1, 2, 16, dropout=0.0),
}
INPUTS = {"transformer": ("src", "tgt")}


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    with pytest.warns(UserWarning) if case == "transformer" else _nothing():   # PyTorch's nested-tensor notice
        m = CASES[case]().double().to(device).train()
    pre = case + "."
    sd = {k[len(pre):]: flame.tensor(v, device=device) for k, v in golden.items()
          if k.startswith(pre) and not k[len(pre):].startswith(("in.", "kw.", "grad.", "out", "go"))}
    assert set(sd) == set(m.state_dict())
    m.load_state_dict(sd)
    names = INPUTS.get(case, ("tgt", "memory"))
    inputs = [flame.tensor(golden[f"{pre}in.{n}"], device=device, requires_grad=True) for n in names]
    kwargs = {}
    for k, v in golden.items():
        if k.startswith(pre + "kw."):
            kwargs[k[len(pre) + 3:]] = flame.tensor(v.astype(bool) if v.dtype == np.uint8 else v, device=device)
    if case == "decoder":
        kwargs["tgt_is_causal"] = True
    out = m(*inputs, **kwargs)
    np.testing.assert_allclose(out.detach().cpu().numpy(), golden[f"{pre}out"], rtol=1e-9, atol=1e-10)
    (out * flame.tensor(golden[f"{pre}go"], device=device)).sum().backward()
    for n, x in zip(names, inputs):
        np.testing.assert_allclose(x.grad.cpu().numpy(), golden[f"{pre}grad.{n}"], rtol=1e-8, atol=1e-10,
                                   err_msg=n)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_transformer_checks_and_mask():
    with pytest.warns(UserWarning):
        m = nn.Transformer(8, 2, 1, 1, 16)
    with pytest.raises(RuntimeError, match="batch number"):
        m(flame.randn(5, 2, 8), flame.randn(4, 3, 8))
    with pytest.raises(RuntimeError, match="d_model"):
        m(flame.randn(5, 2, 8), flame.randn(4, 2, 6))
    mask = nn.Transformer.generate_square_subsequent_mask(3).numpy()
    np.testing.assert_array_equal(mask, np.triu(np.full((3, 3), -np.inf), 1))
    names = [k for k, _ in m.named_parameters()]
    assert "decoder.layers.0.multihead_attn.in_proj_weight" in names and "decoder.norm.weight" in names
