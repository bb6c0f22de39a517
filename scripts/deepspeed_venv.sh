#!/usr/bin/env bash
# Build the venv the benchmarks compare against: DeepSpeed from the package registry, in its own venv
# (never a dependency of zero-offload). Usage: scripts/deepspeed_venv.sh [DIR]   (default: .dsvenv)
# Then: .venv/bin/python -m benchmarks.bench_e2e --ds-python DIR/bin/python   (or export ZO_DS_PYTHON).
# DeepSpeed's NVMe op (async_io) needs libaio-dev; it is installed here, for this venv only, when apt-get
# is available and we are root. Pins: the versions benchmarks/RESULTS.md was measured with.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.dsvenv}"
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq libaio-dev
fi
python3 -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" numpy psutil setuptools wheel \
    py-cpuinfo packaging pydantic hjson ninja tqdm msgpack einops
DS_BUILD_OPS=0 "$dir/bin/pip" install -q --disable-pip-version-check --no-build-isolation "deepspeed==0.19.8"
"$dir/bin/python" -c "import deepspeed; print('deepspeed', deepspeed.__version__, 'in', '$dir')"
