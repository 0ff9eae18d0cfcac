"""Data parallel over 2 pipelines of 2 stages.

    python examples/hybrid_pipeline.py            # = python -m rayconv.run --dp 2 --pp 2 --num-microbatches 2
    python examples/hybrid_pipeline.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '2', '--pp', '2', '--num-microbatches', '2']))
