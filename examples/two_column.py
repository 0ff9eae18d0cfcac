"""Krizhevsky's two-column pattern: conv2 connects only within a column, so it needs no exchange.

    python examples/two_column.py            # = python -m rayconv.run --dp 1 --fs 2 --model convnet2col
    python examples/two_column.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '1', '--fs', '2', '--model', 'convnet2col']))
