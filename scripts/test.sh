#!/usr/bin/env bash
# Install and run the test suite; CI (.ci/run) and the README use exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, pinned: an unpinned torch would pull GBs of CUDA packages,
# and the CI machine has a local CPU wheel of this version.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
# one worker per core (pytest-xdist), each test file on one worker: a file's tests share its module
# fixtures (a gloo launch, the README's scratch directory) and run in order
python -m pytest -n auto --dist loadfile --durations=15 "$@"   # testpaths in pyproject.toml: tests/; the slowest 15 listed last
