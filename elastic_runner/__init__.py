"""elastic_runner: elastic, fault-tolerant training for PyTorch under torchrun."""

__version__ = "0.1.0"
