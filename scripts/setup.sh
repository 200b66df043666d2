#!/usr/bin/env bash
# Creates .venv with radixtier and what it needs. Idempotent: a second run only checks.
#   bash scripts/setup.sh           # the demo's needs: radixtier, SGLang 0.5.23 and what its server imports on CPU
#   bash scripts/setup.sh --test    # plus test needs: pytest, hypothesis, redis-server, fio
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
apt_install() {  # apt_install PACKAGE... : installs what is missing, or says what could not be installed
  command -v apt-get >/dev/null 2>&1 || { echo "setup: please install: $*" >&2; return 1; }
  local SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "$@" >/dev/null; } \
    || { echo "setup: could not install $* with apt-get" >&2; return 1; }
}
# liburing's headers build radixtier's io_uring engine (radixtier/storage/nvmeof/_uring.c); without them the page
# store uses its preadv/pwritev thread pool instead (and says so when it opens).
if [ ! -f /usr/include/liburing.h ]; then
  apt_install liburing-dev || echo "setup: building without the io_uring engine" >&2
fi
# SGLang JIT-builds its HiCache page-hash extension at start-up (torch cpp_extension: ninja, -lcrypto)
missing=""
command -v ninja >/dev/null 2>&1 || missing="$missing ninja-build"
[ -f /usr/include/openssl/sha.h ] || missing="$missing libssl-dev"
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  apt_install $missing || { echo "setup: SGLang's server needs:$missing" >&2; exit 1; }
fi
stamp=.venv/.radixtier-setup
if [ ! -f "$stamp.base" ]; then
  pip install -q --upgrade pip
  # torch 2.14.1 matches sglang 0.5.23 (on these machines it installs from local disk)
  pip install -q torch==2.14.1
  pip install -q -e '.[demo]'
  touch "$stamp.base"
fi
if [ ! -f "$stamp.sglang" ]; then
  # SGLang with --no-deps and only what its cache code and server import on CPU (requirements/sglang-cpu.txt);
  # its full dependency set brings ~11 GB of CUDA wheels. On a GPU node: pip install 'sglang[all]==0.5.23'.
  pip install -q torchvision==0.29.1 -r requirements/sglang-cpu.txt
  pip install -q --no-deps sglang==0.5.23
  touch "$stamp.sglang"
fi
# (re)build the native extensions when a source is newer than its built module, or it is missing
stale() {  # stale SOURCE MODULE_PREFIX
  ! ls "$2"*.so >/dev/null 2>&1 || [ "$1" -nt "$(ls "$2"*.so | head -1)" ]
}
if stale radixtier/_slotpool.c radixtier/_slotpool || stale radixtier/storage/nvmeof/_fence.c radixtier/storage/nvmeof/_fence \
   || { [ -f /usr/include/liburing.h ] && stale radixtier/storage/nvmeof/_uring.c radixtier/storage/nvmeof/_uring; }; then
  pip install -q --no-build-isolation -e '.[demo]'
fi
if [ "$want_test" = 1 ]; then
  if [ ! -f "$stamp.test" ]; then
    pip install -q -e '.[test,demo]'
    touch "$stamp.test"
  fi
  if [ ! -f "$stamp.dynamo" ]; then
    # Dynamo's standalone KV indexer checks radixtier's KV events as a router reads them. --no-deps:
    # its declared dependencies would downgrade pydantic under SGLang; the indexer needs none of them.
    pip install -q --no-deps ai-dynamo-runtime==1.6.1
    touch "$stamp.dynamo"
  fi
  missing=""
  command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
  command -v fio >/dev/null 2>&1 || missing="$missing fio"
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    apt_install $missing || { echo "setup: the Redis and bandwidth tests need:$missing" >&2; exit 1; }
  fi
fi
