#!/usr/bin/env bash
# Install and run the test suite; CI (.ci/run) and the README use exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, pinned: an unpinned torch would pull GBs of CUDA packages,
# and the CI machine has a local CPU wheel of this version.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
python -m pytest --durations=15 "$@"   # testpaths in pyproject.toml: tests/; the slowest 15 listed last
