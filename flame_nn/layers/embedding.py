"""Embedding: a lookup table of num_embeddings vectors (rows picked by integer indices); EmbeddingBag: reduced bags
of them."""
from .. import functional as F
from .. import init
from ..empty_init import new_parameter
from ..module import Module
from ..parameter import Parameter


def _table(module, num_embeddings, embedding_dim, padding_idx, _weight, device, dtype):
    """The lookup table of Embedding / EmbeddingBag: sizes, padding_idx (negative counts from the end), and the
    weight -- a fresh normal one (padding row zero) or `_weight` itself."""
    owner = type(module).__name__
    if padding_idx is not None:
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"{owner}: padding_idx {padding_idx} must be within num_embeddings {num_embeddings}")
        padding_idx %= num_embeddings
    module.num_embeddings, module.embedding_dim, module.padding_idx = num_embeddings, embedding_dim, padding_idx
    if _weight is None:
        module.weight = new_parameter((num_embeddings, embedding_dim), dtype, device)
        module.reset_parameters()
        return
    if tuple(_weight.shape) != (num_embeddings, embedding_dim):
        raise ValueError(f"{owner}: _weight of shape {tuple(_weight.shape)} does not match num_embeddings, "
                         f"embedding_dim ({num_embeddings}, {embedding_dim})")
    module.weight = Parameter(_weight)


class Embedding(Module):
    """A lookup table of num_embeddings vectors of embedding_dim, PyTorch's signature: padding_idx's row starts at
    zero and gets no gradient; max_norm renormalises the rows looked up (in place); scale_grad_by_freq scales their
    gradients by 1 / frequency in the batch; `_weight` (num_embeddings, embedding_dim) is used as the weight itself
    (from_pretrained's way), `_freeze` makes it not require grad."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False, device=None, dtype=None):
        super().__init__()
        if sparse:
            raise NotImplementedError("Embedding: sparse=True needs sparse gradients, which FLAME does not have")
        _table(self, num_embeddings, embedding_dim, padding_idx, _weight, device, dtype)
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, scale_grad_by_freq
        self.sparse = sparse
        if _freeze:
            self.weight.requires_grad_(False)

    def reset_parameters(self):
        init.normal_(self.weight)
        if self.padding_idx is not None and not self.weight.is_meta:
            from flame_core.autograd import no_grad
            with no_grad():
                self.weight[self.padding_idx] = 0

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, sparse=False):
        """An Embedding whose weight is `embeddings` (num_embeddings, embedding_dim), shared (no copy) and frozen
        unless freeze=False; padding_idx's row is left as given."""
        if embeddings.ndim != 2:
            raise ValueError(f"Embeddings parameter is expected to be 2-dimensional, got {tuple(embeddings.shape)}")
        return cls(*embeddings.shape, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                   scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, _weight=embeddings, _freeze=freeze)

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s


class EmbeddingBag(Module):
    """Sums, means or maxima of bags of embeddings (F.embedding_bag) without the per-index embeddings in between:
    forward(input, offsets=None, per_sample_weights=None) -> (B, embedding_dim)."""

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                 mode="mean", sparse=False, _weight=None, include_last_offset=False, padding_idx=None, device=None,
                 dtype=None):
        super().__init__()
        _table(self, num_embeddings, embedding_dim, padding_idx, _weight, device, dtype)
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, scale_grad_by_freq
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset

    reset_parameters = Embedding.reset_parameters

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                        mode="mean", sparse=False, include_last_offset=False, padding_idx=None):
        """An EmbeddingBag whose weight is `embeddings` (num_embeddings, embedding_dim), shared (no copy) and frozen
        unless freeze=False."""
        if embeddings.ndim != 2:
            raise ValueError(f"Embeddings parameter is expected to be 2-dimensional, got {tuple(embeddings.shape)}")
        bag = cls(*embeddings.shape, max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq,
                  mode=mode, sparse=sparse, _weight=embeddings, include_last_offset=include_last_offset,
                  padding_idx=padding_idx)
        bag.weight.requires_grad_(not freeze)
        return bag

    def forward(self, input, offsets=None, per_sample_weights=None):
        return F.embedding_bag(input, self.weight, offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                               self.mode, self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += f", scale_grad_by_freq={self.scale_grad_by_freq}"
        s += f", mode='{self.mode}'"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
