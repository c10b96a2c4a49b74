"""Data-parallel training on torch.distributed with the bits of one device (DESIGN §5, §9).

torch is imported only when a process group is set up, so this package imports without it."""
from .collectives import Comm, CommError, DistError, norm_from_partials, owner_fold
from .sharding import (ALIGN, Shard, ShardingError, check_worker_count, dyadic_blocks, microbatch_range,
                       shard_elements, valid_worker_counts)
from .trainer import DistributedTrainer, in_worker_env, run_worker, worker_main

__all__ = ["ALIGN", "Comm", "CommError", "DistError", "DistributedTrainer", "Shard", "ShardingError",
           "check_worker_count", "dyadic_blocks", "in_worker_env", "microbatch_range", "norm_from_partials",
           "owner_fold", "run_worker", "shard_elements", "valid_worker_counts", "worker_main"]
