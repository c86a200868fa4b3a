#!/usr/bin/env bash
# Set up Tidal with its test dependencies and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TIDAL_EXTRAS="[test]" bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
