"""Datasets and the DataLoader with PyTorch's names and semantics (torch.utils.data), producing flame_core Tensors.

    from flame_core.utils.data import DataLoader, TensorDataset, random_split
    g = flame.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g, num_workers=2)
"""
from .collate import collate, default_collate, default_collate_fn_map, default_convert
from .dataloader import DataLoader
from .dataset import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from .distributed import DistributedSampler
from .pin_memory import pin_memory
from .sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from .worker import WorkerInfo, get_worker_info

__all__ = ["DataLoader", "Dataset", "IterableDataset", "TensorDataset", "StackDataset", "Subset", "ConcatDataset",
           "ChainDataset", "random_split", "Sampler", "SequentialSampler", "RandomSampler", "SubsetRandomSampler",
           "WeightedRandomSampler", "DistributedSampler", "BatchSampler", "default_collate", "default_convert",
           "collate", "default_collate_fn_map", "pin_memory", "get_worker_info", "WorkerInfo"]
