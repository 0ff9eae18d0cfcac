#!/usr/bin/env bash
# Makes docs/dashboard.png: the Ray dashboard's Actors page in headless chromium while a rayconv run
# (data parallel, 2 actors) goes. Needs chromium (apt-get install chromium) and rayconv importable.
# Run from the repository root: bash docs/dashboard_screenshot.sh
# Its Ray head takes free ports only, so other Ray instances on the host are left alone.
set -euo pipefail
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GCS=$(free_port); DASH=$(free_port)
TMP=$(mktemp -d /tmp/rc-shot-XXXX)
export RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT=180  # the dashboard's modules start slowly on a loaded machine
setsid ray start --head --block --num-cpus 4 --include-dashboard true --dashboard-host 127.0.0.1 --temp-dir "$TMP" \
    --port "$GCS" --dashboard-port "$DASH" --dashboard-agent-listen-port "$(free_port)" \
    --dashboard-agent-grpc-port "$(free_port)" --metrics-export-port "$(free_port)" \
    --runtime-env-agent-port "$(free_port)" --ray-client-server-port "$(free_port)" >/dev/null &
HEAD=$!
RUN=
cleanup() {  # (a background job ignores SIGINT here: SIGTERM stops the run, which stops its actors)
    [ -n "$RUN" ] && kill -TERM "$RUN" 2>/dev/null && wait "$RUN" || true
    kill -TERM "$HEAD" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$HEAD" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$HEAD" 2>/dev/null || true  # whatever is left of the head's own process group
    rm -rf "$TMP"
}
trap cleanup EXIT
until [ -e "$TMP/ray_current_cluster" ]; do sleep 0.5; done
python -m rayconv.run --address "127.0.0.1:$GCS" --dp 2 --device cpu --steps 100000 --no-progress \
    --out "$TMP/demo" >/dev/null 2>&1 &
RUN=$!
python - "$DASH" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/api/v0/actors?limit=1000&detail=false"
for _ in range(240):
    rows = json.load(urllib.request.urlopen(url))["data"]["result"]["result"]
    if sum(r["state"] == "ALIVE" and (r.get("name") or "").startswith("rayconv/demo-") for r in rows) == 2:
        break
    time.sleep(0.5)
else:
    sys.exit("the run's actors did not start within 120 s")
PY
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,720 \
    --virtual-time-budget=20000 --screenshot="docs/dashboard.png" "http://127.0.0.1:$DASH/#/actors"
