"""``python -m rayconv.bench``: the command line of the benchmarks."""

import sys

from rayconv.bench.measure import main

sys.exit(main())
