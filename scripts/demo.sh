#!/usr/bin/env bash
# The project's main job: set up .venv, build, then run the demo. Extra args go to the demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" >&2
cd "$root"
exec "$py" -m zero.examples.demo "$@"
