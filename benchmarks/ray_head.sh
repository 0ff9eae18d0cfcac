# Sourced by the benchmarks that run rayconv on a Ray cluster started first, as a user's `ray start --head`
# starts one, on ports and a temp folder of its own, so that no other Ray of the host is touched:
#   source benchmarks/ray_head.sh; start_head PORT LOG [ray start's flags...] || exit 1; ...; stop_head
# start_head sets TMPD (the cluster's temp folder) and has stop_head run at the shell's exit; stop_head ends
# the cluster's processes (those whose command lines name TMPD, and every process below them: the agents and
# workers, whose titles Ray renames to ray::...; and Ray Client's server, which `ray start` leaves to init and
# whose command line names the head's port instead), then removes TMPD.
start_head() {
  local port=$1 log=$2; shift 2
  local ray=(ray); command -v ray > /dev/null || ray=("${PY:-python3}" -m ray.scripts.scripts)   # (Ray on PYTHONPATH without its script)
  TMPD=$(mktemp -d /tmp/ray-head-XXXXXX) HEAD_PORT=$port
  trap stop_head EXIT
  "${ray[@]}" start --head --port "$port" --temp-dir "$TMPD" --dashboard-port $((port + 2000)) \
    --ray-client-server-port $((port + 13700)) --dashboard-agent-listen-port $((port + 3000)) \
    --min-worker-port $((port + 14600)) --max-worker-port $((port + 15599)) \
    --include-dashboard false "$@" > "$log" 2>&1 || { echo "ray start failed:"; tail -5 "$log"; return 1; }
}
stop_head() {
  [ -n "${TMPD:-}" ] || return 0
  local pids; pids=$(_process_tree $(pgrep -f -- "$TMPD") $(pgrep -f -- "ray.util.client.server --address=[^ ]*:$HEAD_PORT( |$)"))
  [ -n "$pids" ] && { kill $pids 2>/dev/null; sleep 2; kill -9 $pids 2>/dev/null; }
  rm -rf "$TMPD"; TMPD=
}
_process_tree() {  # the given process ids and all their descendants
  local p
  for p in "$@"; do echo "$p"; _process_tree $(pgrep -P "$p"); done
}
