"""Optimizers and learning-rate schedules."""
from . import lr_scheduler
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamw8bit import AdamW8bit
from .optimizer import Optimizer
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "AdamW8bit", "RMSprop", "Adagrad", "lr_scheduler"]
