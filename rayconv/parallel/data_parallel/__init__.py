"""Data parallelism (Yadan et al. 2013; bucketing and overlap as PyTorch DDP, Li et al. VLDB 2020):

    gradient_sync.py   the bucketed, backward-overlapped gradient all-reduce (``GradientSync``) and
                       the broadcast that starts replicas identical (``broadcast_modules``)
"""

from rayconv.parallel.data_parallel.gradient_sync import GradientSync, broadcast_modules

__all__ = ["GradientSync", "broadcast_modules"]
