"""trainkit: one YAML recipe -> a correct, fast, observable distributed PyTorch training run."""

from .registry import model_factory

__version__ = "0.1.0"
__all__ = ["model_factory", "__version__"]
