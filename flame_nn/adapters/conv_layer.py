"""The adapted Conv2d: a Conv2d that also runs the (LoCon) adapters attached to it.

    y = base(x)                                  # the layer's own convolution
    y += w_a · adapter_a(x)                      # every enabled, unmerged adapter (in place), all output channels

An adapter on a convolution covers all its output channels (no row ranges: no model fuses convolutions the way Flux
fuses q/k/v). Only LoRA adapts convolutions (locon.py: down = a conv with the base's kernel, stride, padding and
dilation, up = a 1x1 conv), as PEFT's and kohya's LoRA do; grouped convolutions and padding modes other than zeros
are refused (neither reads them).
"""
from .layer import AdaptedMixin, AdapterError, add_rows


def check_conv(conv):
    """AdapterError unless a LoRA can adapt `conv` (groups 1, zero padding)."""
    if conv.groups != 1:
        raise AdapterError(f"{conv!r}: adapters on grouped convolutions (groups={conv.groups}) are not supported")
    if conv.padding_mode != "zeros":
        raise AdapterError(f"{conv!r}: adapters on convolutions with padding_mode={conv.padding_mode!r} are not "
                           f"supported (only 'zeros')")


class AdaptedConv2dMixin(AdaptedMixin):
    """Mixed in front of a Conv2d class by `adapt`."""

    def forward(self, input):
        y = super().forward(input)
        for lo, hi, ad, mult in self._active():
            d = ad.delta(input)
            d = d if mult == 1.0 else d * mult
            if tuple(d.shape) != tuple(y.shape):
                raise AdapterError(f"{ad!r} gives {tuple(d.shape)} for this Conv2d's output {tuple(y.shape)}")
            y = add_rows(y, d, 0, y.shape[-1])           # the whole output, in y's storage
        return y

    def _check_fit(self, adapter, lo, hi):
        from .locon import LoRAConv2d
        if not isinstance(adapter, LoRAConv2d):
            raise AdapterError(f"a {type(adapter).__name__} adapter cannot adapt a Conv2d; convolutions take LoRA "
                               f"(LoRAConv2d) adapters")
        if (lo, hi) != (0, self.out_channels):
            raise AdapterError(f"an adapter on a Conv2d covers all {self.out_channels} output channels, not "
                               f"[{lo}:{hi}]")
        mine = (self.in_channels, self.out_channels, tuple(self.kernel_size), tuple(self.stride),
                self.padding if isinstance(self.padding, str) else tuple(self.padding), tuple(self.dilation))
        theirs = (adapter.in_features, adapter.out_features, adapter.kernel_size, adapter.stride, adapter.padding,
                  adapter.dilation)
        if mine != theirs:
            raise AdapterError(f"adapter (in, out, kernel, stride, padding, dilation) {theirs} does not fit a Conv2d "
                               f"{mine}")
