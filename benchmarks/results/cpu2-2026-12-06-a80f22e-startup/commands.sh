# The 2-core machine, quiet (load average < 1 at the start), 2026-12-06: start-up of a first command on a running
# cluster: commit e4dad95 (a worktree, BASE) then commit a80f22e, one after the other; a80f22e with an empty
# model-check cache, so that its first command checks the model before Ray.
cd BASE && PYTHONPATH=BASE NEW=1 REPEAT=3 SELF=0 PORT=6471 bash benchmarks/startup.sh cpu OUT/base > base_e4dad95.txt
RAYCONV_CACHE_DIR=EMPTY NEW=1 REPEAT=3 SELF=0 PORT=6472 bash benchmarks/startup.sh cpu OUT/head > head_a80f22e.txt
