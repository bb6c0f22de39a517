#!/usr/bin/env bash
# The project's test command: set up .venv, build, lint, then run pytest. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
find aio_csrc ops_csrc -name '*.cpp' -o -name '*.h' | xargs "$venv/bin/clang-format" --dry-run --Werror
"$py" -m pytest "$@"
