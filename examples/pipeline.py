"""Pipeline (layer split): 2 stages, 4 micro-batches, 1F1B schedule.

    python examples/pipeline.py  # = python -m rayconv.run --dp 1 --pp 2 --num-microbatches 4 --schedule 1f1b
    python examples/pipeline.py --smoke  # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '1', '--pp', '2', '--num-microbatches', '4', '--schedule', '1f1b']))
