#!/usr/bin/env bash
# End-to-end test of the live web view (`GET /` of `tokenrouter serve`) in headless
# Chromium, on the real engine with a tiny synthetic model pair:
#   1. builds target/release/tokenrouter and the make_tiny_pair example,
#   2. writes the tiny pair and its config into a temporary directory,
#   3. starts `tokenrouter serve` on a free local port and waits for /health,
#   4. runs the front-end unit tests (Node) and the Playwright test (web.e2e.mjs),
#   5. stops the server and prints where the screenshots are.
#
# Usage: crates/server/tests/browser/run.sh [--config <yaml>]
#   --config    serve this config instead of the tiny pair (e.g. the default CPU pair:
#               config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml, models fetched beforehand)
# Environment: CARGO_TARGET_DIR, CHROMIUM (default /usr/bin/chromium), ARTIFACTS (default
# crates/server/tests/browser/artifacts), PORT (default: a free one), PROMPT, MAX_TOKENS.
# Needs Node >= 20 and Debian's chromium (`apt-get install -y chromium`); the first run
# installs playwright-core from package-lock.json (`npm ci`).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
export ARTIFACTS=${ARTIFACTS:-$HERE/artifacts}
CONFIG=""
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

start=$(date +%s)
command -v node >/dev/null || { echo "node (>= 20) is needed" >&2; exit 1; }
[ -x "$CHROMIUM" ] || { echo "no Chromium at $CHROMIUM (apt-get install -y chromium)" >&2; exit 1; }
mkdir -p "$ARTIFACTS"
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== build (release)"
(cd "$ROOT" && cargo build --release -p tokenrouter --bin tokenrouter --example make_tiny_pair)
BIN=$TARGET/release/tokenrouter

if [ -z "$CONFIG" ]; then
  echo "== tiny synthetic pair"
  CONFIG=$("$TARGET/release/examples/make_tiny_pair" "$WORK/pair")
fi

PORT=${PORT:-$(node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')}
export BASE_URL="http://127.0.0.1:$PORT"
echo "== serve $CONFIG on $BASE_URL (log: $ARTIFACTS/server.log)"
"$BIN" serve --config "$CONFIG" --host 127.0.0.1 --port "$PORT" >"$ARTIFACTS/server.log" 2>&1 &
SERVER_PID=$!
ready=""
for _ in $(seq 1 600); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "the server exited:" >&2; tail -20 "$ARTIFACTS/server.log" >&2; exit 1
  fi
  if node -e 'fetch(process.argv[1]).then(r=>r.json()).then(j=>process.exit(j.status==="ok"?0:1),()=>process.exit(1))' "$BASE_URL/health"; then
    ready=1; break
  fi
  sleep 0.5
done
[ -n "$ready" ] || { echo "the server did not become ready" >&2; tail -20 "$ARTIFACTS/server.log" >&2; exit 1; }

cd "$HERE"
if [ ! -d node_modules/playwright-core ]; then
  echo "== npm ci (playwright-core)"
  npm ci --no-audit --no-fund
fi
echo "== front-end unit tests"
node --experimental-detect-module --test unit.test.mjs
echo "== browser test"
node web.e2e.mjs
echo "== passed in $(( $(date +%s) - start )) s; screenshots:"
ls -1 "$ARTIFACTS"/*.png
