"""shardc: a torch.compile backend for compiler-planned fully-sharded data-parallel training."""

__version__ = "0.1.0"
