#!/usr/bin/env bash
# Installs the test needs (scripts/setup.sh --test) and runs the whole test suite.
# Tests start their own redis-server processes and loop devices; a run that collects no
# test is a failure, not a pass (pytest exit 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || { echo "test setup failed" >&2; exit 1; }
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
