"""Data parallelism (Yadan et al. 2013, section 3.1): 2 replicas, gradients all-reduced.

    python examples/data_parallel.py            # = python -m rayconv.run --dp 2
    python examples/data_parallel.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '2']))
