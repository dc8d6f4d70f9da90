"""trainkit: one YAML recipe -> a correct, fast, observable distributed PyTorch training run."""

__version__ = "0.1.0"
