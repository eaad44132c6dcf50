"""Dropout, Dropout1d, Dropout2d, Dropout3d, AlphaDropout, FeatureAlphaDropout."""
from .. import functional as F
from ..module import Module


class Dropout(Module):
    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input):
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"


class Dropout1d(Dropout):
    """Whole channels of (N, C, L) or (C, L) zeroed with probability p (F.dropout1d)."""

    def forward(self, input):
        return F.dropout1d(input, self.p, self.training, self.inplace)


class Dropout2d(Dropout):
    """Whole channels of (N, C, H, W) zeroed with probability p (F.dropout2d)."""

    def forward(self, input):
        return F.dropout2d(input, self.p, self.training, self.inplace)


class Dropout3d(Dropout):
    """Whole channels of (N, C, D, H, W) or (C, D, H, W) zeroed with probability p (F.dropout3d)."""

    def forward(self, input):
        return F.dropout3d(input, self.p, self.training, self.inplace)


class AlphaDropout(Dropout):
    """SELU-preserving dropout (F.alpha_dropout): dropped units take SELU's saturation value, then an affine map
    keeps the mean and variance."""

    def forward(self, input):
        return F.alpha_dropout(input, self.p, self.training, self.inplace)


class FeatureAlphaDropout(Dropout):
    """AlphaDropout of whole channels of (N, C, *) (F.feature_alpha_dropout)."""

    def forward(self, input):
        return F.feature_alpha_dropout(input, self.p, self.training, self.inplace)
