#!/usr/bin/env bash
# Set up Tidal and run it on its built-in demo model. Extra arguments go to `tidal generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then
  set -- --prompt "def fibonacci(n):" --max-tokens 64
fi
tidal generate "$@"
