"""Conv3d, ConvTranspose1d and ConvTranspose3d modules (their functional forms are checked against PyTorch in
tests/core/test_torch_surface_golden.py): PyTorch's parameter layout and repr, padding modes, the output_size rule,
and the argument errors."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F


def test_conv3d_module_layout_padding_modes_and_repr(device):
    flame.manual_seed(0)
    m = nn.Conv3d(4, 6, (3, 2, 3), stride=(1, 2, 1), padding=(1, 0, 1), padding_mode="circular", bias=True)
    m = m.to(device)
    assert tuple(m.weight.shape) == (6, 4, 3, 2, 3) and tuple(m.bias.shape) == (6,)
    assert repr(m) == ("Conv3d(4, 6, kernel_size=(3, 2, 3), stride=(1, 2, 1), padding=(1, 0, 1), "
                       "padding_mode=circular)")
    x = flame.randn(2, 4, 5, 6, 7, device=device)
    want = F.conv3d(F.pad(x, (1, 1, 0, 0, 1, 1), mode="circular"), m.weight, m.bias, (1, 2, 1))
    np.testing.assert_allclose(m(x).detach().cpu().numpy(), want.detach().cpu().numpy(), rtol=1e-6, atol=1e-6)
    assert tuple(nn.Conv3d(4, 2, 3, padding="same").to(device)(x).shape) == (2, 2, 5, 6, 7)
    with pytest.raises(ValueError, match="a triple, 'same' or 'valid'"):
        nn.Conv3d(4, 2, 3, padding="full")
    with pytest.raises(flame.ShapeError, match="channels"):
        F.conv3d(x, flame.randn(2, 3, 1, 1, 1, device=device))


@pytest.mark.parametrize("cls,spatial", [(nn.ConvTranspose1d, (7,)), (nn.ConvTranspose3d, (3, 4, 5))])
def test_transposed_modules_output_size_and_errors(cls, spatial, device):
    k = len(spatial)
    m = cls(4, 6, 3, stride=2, padding=1, groups=2).to(device)
    assert tuple(m.weight.shape) == (4, 3) + (3,) * k
    x = flame.randn(*((2, 4) + spatial), device=device)
    base = tuple(m(x).shape[2:])
    assert base == tuple((n - 1) * 2 - 2 + 3 for n in spatial)
    bigger = tuple(b + 1 for b in base)
    y = m(x, output_size=bigger)
    assert tuple(y.shape) == (2, 6) + bigger
    np.testing.assert_allclose(y.detach().cpu().numpy(),
                               type(m)._fn(x, m.weight, m.bias, 2, 1, 1, 2).detach().cpu().numpy(), rtol=1e-6)
    with pytest.raises(flame.ShapeError, match="requested output size"):
        m(x, output_size=tuple(b + 2 for b in base))
    with pytest.raises(ValueError, match="output_padding"):
        cls(4, 6, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="zeros"):
        cls(4, 6, 3, padding_mode="reflect")


def test_3d_pooling_modules_are_their_functions(device):
    x = flame.randn(2, 3, 5, 6, 7, device=device)
    cases = [(nn.MaxPool3d(2, stride=1, padding=1, ceil_mode=True), lambda t: F.max_pool3d(t, 2, 1, 1, 1, True)),
             (nn.AvgPool3d(3, 2, 1, count_include_pad=False), lambda t: F.avg_pool3d(t, 3, 2, 1, False, False)),
             (nn.AdaptiveAvgPool3d((2, 3, 1)), lambda t: F.adaptive_avg_pool3d(t, (2, 3, 1))),
             (nn.AdaptiveMaxPool3d(2), lambda t: F.adaptive_max_pool3d(t, 2))]
    for m, fn in cases:
        np.testing.assert_array_equal(m(x).detach().cpu().numpy(), fn(x).detach().cpu().numpy())
        assert tuple(m(x[0]).shape) == tuple(fn(x).shape[1:])   # unbatched (C, D, H, W)
    assert repr(nn.MaxPool3d(2)) == "MaxPool3d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)"
    out, ind = nn.MaxPool3d(2, return_indices=True)(x)
    np.testing.assert_array_equal(out.detach().cpu().numpy(), F.max_pool3d(x, 2).detach().cpu().numpy())
    flat = x.reshape(2, 3, -1).detach().cpu().numpy()
    np.testing.assert_array_equal(np.take_along_axis(flat, ind.reshape(2, 3, -1).cpu().numpy(), 2),
                                  out.reshape(2, 3, -1).detach().cpu().numpy())   # the indices point at the maxima
    assert nn.AdaptiveMaxPool3d(2, return_indices=True)(x)[1].dtype == flame.int64
    with pytest.raises(ValueError, match="padding"):
        F.max_pool3d(x, 2, padding=(2, 0, 0))
    with pytest.raises(flame.ShapeError, match="max_pool3d"):
        F.max_pool3d(x[0, 0], 2)
