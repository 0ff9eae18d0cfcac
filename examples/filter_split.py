"""Filter split (Krizhevsky et al. 2012): each layer's filters over 2 actors.

    python examples/filter_split.py            # = python -m rayconv.run --dp 1 --fs 2
    python examples/filter_split.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '1', '--fs', '2']))
