# Sourced on the lent GPU machine after .device/setup.sh, before a start-up benchmark: compiles the
# bytecode of what setup.sh puts in place without it (Ray and its dependencies, unpacked into /tmp/site
# with --no-compile, and rayconv, read from the checkout through PYTHONPATH) beside their sources, as
# `pip install ray` and `pip install .` do for what they install. The machine's own packages (torch,
# torchvision, numpy) stay as they are, without bytecode, and PYTHONDONTWRITEBYTECODE stays set: the
# plain script and rayconv import torch as that machine's users do, and rayconv and Ray as a user who
# installed them with pip does.
#   source .device/setup.sh && source benchmarks/installed.sh      # SITE=/tmp/site
_in_start=$(date +%s.%N)
_in_roots=("${SITE:-/tmp/site}" rayconv)
env -u PYTHONPYCACHEPREFIX ${PY:-python3} -m compileall -q -j 0 "${_in_roots[@]}" > /dev/null 2>&1
echo "installed: ${_in_roots[*]} compiled beside their sources in $(awk "BEGIN {print $(date +%s.%N) - $_in_start}") s ($(find "${_in_roots[@]}" -name '*.pyc' | wc -l) files)"
