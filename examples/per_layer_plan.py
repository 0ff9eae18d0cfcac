"""Krizhevsky 2014 (one weird trick): conv layers data parallel, FC layers split.

    python examples/per_layer_plan.py            # = python -m rayconv.run --dp 2 --plan krizhevsky2014
    python examples/per_layer_plan.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '2', '--plan', 'krizhevsky2014']))
