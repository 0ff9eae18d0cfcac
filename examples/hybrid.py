"""The paper's 4-GPU hybrid: 2 data-parallel groups of 2 filter-split actors.

    python examples/hybrid.py            # = python -m rayconv.run --dp 2 --fs 2
    python examples/hybrid.py --smoke    # 3 steps

Any other flag of `python -m rayconv.run` can be added (e.g. --model alexnet --data synthetic --device cuda).
"""

import sys

from _common import run_layout

if __name__ == "__main__":
    sys.exit(run_layout(['--dp', '2', '--fs', '2']))
