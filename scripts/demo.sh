#!/usr/bin/env bash
# Set up Tidal and run it on its built-in demo model. Extra arguments go to `tidal generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then
  set -- --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0.6 --top-p 0.9 --seed 1 \
    --repetition-penalty 1.15
fi
tidal generate "$@"
