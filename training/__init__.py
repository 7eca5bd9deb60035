"""Training of draft heads: self-distilled data (``data``), DeepSpeed training (``trainer``)."""

from .train_config import TrainConfig
from .trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
