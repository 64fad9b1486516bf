"""shardc: a torch.compile backend for compiler-planned fully-sharded data-parallel training."""

from shardc.backend import backend, shardc_backend
from shardc.options import ShardcOptions
from shardc.runtime.sharding import MixedPrecisionPolicy, is_sharded, shard, shard_state

__version__ = "0.1.0"

__all__ = [
    "MixedPrecisionPolicy",
    "ShardcOptions",
    "backend",
    "is_sharded",
    "shard",
    "shard_state",
    "shardc_backend",
]
