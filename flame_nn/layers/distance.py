"""CosineSimilarity and PairwiseDistance as modules."""
from .. import functional as F
from ..module import Module


class CosineSimilarity(Module):
    def __init__(self, dim=1, eps=1e-8):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1, x2):
        return F.cosine_similarity(x1, x2, self.dim, self.eps)

    def extra_repr(self):
        return f"dim={self.dim}, eps={self.eps}"


class PairwiseDistance(Module):
    def __init__(self, p=2.0, eps=1e-6, keepdim=False):
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1, x2):
        return F.pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)

    def extra_repr(self):
        return f"p={self.norm}, eps={self.eps}, keepdim={self.keepdim}"
