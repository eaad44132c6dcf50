"""Optimizers and learning-rate schedules."""
from . import lr_scheduler
from .adafactor import Adafactor
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamw8bit import AdamW8bit
from .lion import Lion
from .optimizer import Optimizer
from .prodigy import Prodigy
from .rmsprop import RMSprop
from .schedulefree import AdamWScheduleFree
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "AdamW8bit", "Adafactor", "Lion", "Prodigy", "AdamWScheduleFree",
           "RMSprop", "Adagrad", "lr_scheduler"]
