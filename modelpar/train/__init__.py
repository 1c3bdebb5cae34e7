"""Training: config, data, loop, metrics."""

from modelpar.train.config import TrainConfig
from modelpar.train.runner import train

__all__ = ["TrainConfig", "train"]
