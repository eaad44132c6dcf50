"""The location-scale families' shared part (Normal, Laplace, Cauchy): loc and scale broadcast together, scale > 0
checked, the mode at loc."""
from .distribution import Distribution, broadcast_all


class LocScale(Distribution):
    has_rsample = True

    def __init__(self, loc, scale, validate_args=None):
        self.loc, self.scale = broadcast_all(loc, scale)
        super().__init__(self.loc.shape, (), validate_args)
        self._check_param("scale", self.scale > 0, "GreaterThan(lower_bound=0.0)")

    @property
    def mean(self):
        return self.loc

    @property
    def mode(self):
        return self.loc
