# Sourced before a start-up benchmark on a machine whose Python packages carry no bytecode and whose
# environment sets PYTHONDONTWRITEBYTECODE (the lent GPU machine: torch ships without __pycache__, so
# every process compiles each module it imports from source). Compiles every folder on sys.path once,
# as `pip install` does at install time, into a cache folder of its own (PYTHONPYCACHEPREFIX, exported
# for this shell and every process it starts: the plain script, rayconv's driver, `ray start` and the
# Ray workers). The anchor and rayconv then import as they would from a normal install.
#   source benchmarks/bytecode.sh            # PY=python3, cache PYCACHE=/tmp/pycache
export PYTHONPYCACHEPREFIX=${PYCACHE:-/tmp/pycache}
_bc_start=$(date +%s.%N)
mapfile -t _bc_roots < <(${PY:-python3} -c 'import os, sys; [print(p) for p in sys.path if p and os.path.isdir(p)]')
${PY:-python3} -m compileall -q -j 0 "${_bc_roots[@]}" > /dev/null 2>&1
echo "bytecode: ${#_bc_roots[@]} folders of sys.path compiled into $PYTHONPYCACHEPREFIX in $(awk "BEGIN {print $(date +%s.%N) - $_bc_start}") s ($(find "$PYTHONPYCACHEPREFIX" -name '*.pyc' | wc -l) files)"
