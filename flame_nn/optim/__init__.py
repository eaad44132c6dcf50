"""Optimizers and learning-rate schedules."""
from . import lr_scheduler
from .adadelta import Adadelta
from .adafactor import Adafactor
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamax import Adamax
from .adamw8bit import AdamW8bit
from .asgd import ASGD
from .lbfgs import LBFGS
from .lion import Lion
from .muon import Muon
from .nadam import NAdam
from .optimizer import Optimizer
from .prodigy import Prodigy
from .radam import RAdam
from .rmsprop import RMSprop
from .rprop import Rprop
from .schedulefree import AdamWScheduleFree
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "AdamW8bit", "Adafactor", "Lion", "Prodigy", "AdamWScheduleFree",
           "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop", "LBFGS", "Muon",
           "lr_scheduler"]
