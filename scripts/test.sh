#!/usr/bin/env bash
# The test command: run from a fresh clone on a machine with Rust (rustup) and Python 3 + pip.
#
#   1. installs what the tests need when missing: rustfmt and clippy (rustup), the `openai`
#      and `anthropic` Python packages (for the end-to-end tests with the official clients);
#   2. checks formatting (cargo fmt --check);
#   3. fetches the two real models (Qwen2.5-Coder 0.5B/1.5B Q4_K_M GGUF, ~1.6 GB, sha256-
#      verified; a no-op when cached) — `tokenrouter fetch`;
#   4. runs every test of the workspace in release mode, with the real models required
#      (TOKENROUTER_NO_SKIP=1: every test that would skip for something missing
#      — models, python3 with `openai` or `anthropic` — fails instead);
#   5. runs the web view's end-to-end test in headless Chromium (installs Debian's chromium);
#   6. runs clippy on every target with warnings as errors;
#   7. checks that the engine builds as a library without the download stack and the
#      synthetic-model writers (`fetch`, `synth` off);
#   8. installs the Python package as a user would (a fresh venv, `pip install ./python`:
#      maturin builds the wheel from crates.io and PyPI only) and runs its pytest suite;
#   9. runs the helper scripts' own tests (scripts/tests, standard-library unittest).
# fmt, tests and clippy all run even when an earlier one fails; the summary names the failures.
#
# Environment: CARGO_TARGET_DIR (default target/), TOKENROUTER_CACHE (model cache, default
# ~/.cache/tokenrouter), SKIP_CLIPPY=1 / SKIP_FETCH=1 to leave a step out (local use only).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
elapsed() { echo "$(( $(date +%s) - start ))s"; }
start=$(date +%s)
failed=()
# Run a check; on failure note it and go on, so one run reports every problem.
check() {
  local name=$1
  shift
  step "$name ($(elapsed))"
  if ! "$@"; then
    failed+=("$name")
    printf '\n!!! %s FAILED\n' "$name"
  fi
}

step "toolchain"
command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 not found" >&2; exit 1; }
cargo --version
for component in rustfmt clippy; do
  if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$component"
  fi
done

step "browser for the web view test"
if [ ! -x /usr/bin/chromium ]; then
  # Debian's Chromium for the headless end-to-end test of the web view (issue: live view).
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; }
  else sudo apt-get install -y -q chromium; fi
fi
command -v node >/dev/null || { echo "node (>= 20) is needed for the web view test" >&2; exit 1; }

step "python packages"
if ! python3 -c "import openai, anthropic" 2>/dev/null; then
  # Debian's system Python refuses plain `pip install` (PEP 668): fall back to a user install.
  python3 -m pip install --quiet openai anthropic \
    || python3 -m pip install --quiet --user --break-system-packages openai anthropic
fi
python3 -c "import openai, anthropic; print('openai', openai.__version__, 'anthropic', anthropic.__version__)"

check "cargo fmt --check" cargo fmt --all --check

if [ "${SKIP_FETCH:-0}" != 1 ]; then
  step "fetch the default models ($(elapsed))"
  cargo run --release -p tokenrouter -- fetch
fi

export TOKENROUTER_NO_SKIP=1
check "cargo test --workspace --release" cargo test --workspace --release --no-fail-fast

# The live web view in headless Chromium against a server on tiny synthetic models
# (screenshots in crates/server/tests/browser/artifacts/).
check "web view in headless Chromium" crates/server/tests/browser/run.sh

if [ "${SKIP_CLIPPY:-0}" != 1 ]; then
  check "cargo clippy" cargo clippy --workspace --all-targets --release --keep-going -- -D warnings
fi

# The engine as a library without the download stack and the synthetic-model writers
# (`fetch` and `synth` off): what a library user builds on.
check "engine without its default features" cargo check --release -p tokenrouter-engine --no-default-features

# The Python package as a user installs it: a fresh venv, `pip install ./python` (reusing
# this workspace's compiled crates through the shared target directory), then pytest on the
# tiny synthetic pair, including the research system's own examples.
python_package() {
  local venv t0
  venv="$(mktemp -d)/venv"
  python3 -m venv "$venv" || { echo "python3 -m venv failed (Debian: apt-get install python3-venv)"; return 1; }
  t0=$(date +%s)
  "$venv/bin/pip" install --quiet "./python[test]" || return 1
  echo "pip install ./python in a fresh venv (with pytest, openai): $(( $(date +%s) - t0 ))s"
  "$venv/bin/python" -m pytest -q python/tests
}
check "python package (fresh venv, pytest)" python_package
check "helper scripts (python3 -m unittest)" python3 -m unittest discover -s scripts/tests

if [ ${#failed[@]} -gt 0 ]; then
  step "FAILED after $(elapsed): ${failed[*]}"
  exit 1
fi
step "all passed in $(elapsed)"
