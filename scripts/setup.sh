#!/usr/bin/env bash
# Creates .venv with radixtier and what it needs. Idempotent: a second run only checks.
#   bash scripts/setup.sh           # the demo's needs
#   bash scripts/setup.sh --test    # plus test needs: SGLang 0.5.23 (CPU, --no-deps), redis-server, fio
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
stamp=.venv/.radixtier-setup
if [ ! -f "$stamp.base" ]; then
  pip install -q --upgrade pip
  # torch 2.14.1 matches sglang 0.5.23 (on these machines it installs from local disk)
  pip install -q torch==2.14.1
  pip install -q -e '.[demo,uring]'
  touch "$stamp.base"
fi
if [ "$want_test" = 1 ]; then
  if [ ! -f "$stamp.test" ]; then
    pip install -q -e '.[test,demo,uring]'
    pip install -q torchvision==0.29.1 -r requirements/sglang-cpu.txt
    pip install -q --no-deps sglang==0.5.23
    touch "$stamp.test"
  fi
  missing=""
  command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
  command -v fio >/dev/null 2>&1 || missing="$missing fio"
  if [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $missing >/dev/null; } \
        || { echo "setup: could not install$missing with apt-get (the Redis and bandwidth tests need them)" >&2; exit 1; }
    else
      echo "setup: please install:$missing" >&2
    fi
  fi
fi
