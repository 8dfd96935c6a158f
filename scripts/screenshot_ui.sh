#!/usr/bin/env bash
# Screenshot of the Prefect UI's deployments page after `ckptflow deploy` of the example fleet,
# for the README. Starts its own Prefect server on 127.0.0.1 (temporary PREFECT_HOME), deploys,
# shoots with headless Chromium (installed from Debian if missing), stops the server.
# Usage: ./scripts/screenshot_ui.sh [docs/prefect-deployments.png]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/prefect-deployments.png}
command -v chromium >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
home=$(mktemp -d)
port=4388
export PREFECT_HOME="$home" PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL="http://127.0.0.1:$port/api"
setsid .venv/bin/prefect server start --host 127.0.0.1 --port $port >"$home/server.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true; rm -rf "$home"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/api/health" >/dev/null 2>&1 && break; sleep 0.5; done
export PREFECT_API_URL="http://127.0.0.1:$port/api"
# The node workers are on other machines: their API URL cannot be this loopback one (deploy
# refuses it). Any routable address does for a screenshot; nothing connects to it.
node_api=10.0.0.1
.venv/bin/ckptflow deploy deployments/example-h200-fleet.yaml --api-url "http://$node_api:4200/api" >/dev/null
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --user-data-dir="$(mktemp -d)" --virtual-time-budget=20000 \
  --window-size=1400,900 --screenshot="$out" "http://127.0.0.1:$port/deployments" >/dev/null 2>&1
echo "wrote $out"
