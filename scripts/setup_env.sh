#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU torch and build zero-offload in editable mode.
# Sourced by scripts/test.sh and scripts/demo.sh so both work on a fresh machine. Incremental: packages are
# installed only when one in scripts/requirements-dev.txt is missing, and the C++ extensions are rebuilt
# only when scripts/build_stamp.py's fingerprint (C++ sources and headers, setup.py, pyproject.toml, flags,
# compiler, Python) differs from the one recorded in the venv after the last build. Progress goes to stderr.
# ZO_VENV=DIR uses another venv; ZO_BUILD_JOBS=N sets the compile jobs (default: one per core).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZO_VENV:-$root/.venv}"
py="$venv/bin/python"
_zo_stamp="$venv/.zo-build-stamp"
_zo_requirements="$root/scripts/requirements-dev.txt"

_zo_say() { echo "setup: $*" >&2; }

# Runs pip quietly (errors still show), without the constraint file's notes; returns pip's status.
_zo_pip() {
    local rc
    set +e
    "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" >&2
    rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}

_zo_missing=""
if [ ! -x "$py" ]; then
    _zo_say "creating the virtual environment $venv"
    python3 -m venv "$venv"
    _zo_missing="a new environment"
fi

if [ -n "$_zo_missing" ] \
    || ! _zo_missing=$("$py" -I "$root/scripts/build_stamp.py" "$root" --requirements "$_zo_requirements" 2>&1); then
    _zo_say "installing pinned packages (${_zo_missing}; first run only, ~2-4 min)"
    _zo_t0=$(date +%s)
    _zo_pip -r "$_zo_requirements"
    "$py" -c "import torch" # fail here, clearly, if the install above did not work
    _zo_say "packages installed in $(($(date +%s) - _zo_t0)) s"
fi

# The editable install builds the C++ extensions in place. No build isolation: the build requirements
# (setuptools, pybind11) are already in the venv, so nothing is fetched and torch is never needed.
if ! _zo_reason=$("$py" -I "$root/scripts/build_stamp.py" "$root" --check "$_zo_stamp" 2>&1); then
    _zo_jobs="${ZO_BUILD_JOBS:-$(nproc 2>/dev/null || echo 1)}"
    _zo_say "building the C++ extensions (${_zo_reason}; ${_zo_jobs} jobs, ~40 s on 2 idle cores)"
    _zo_t0=$(date +%s)
    rm -f "$_zo_stamp"
    (unset ZO_BUILD_ONLY && export ZO_BUILD_JOBS="$_zo_jobs" && _zo_pip --no-build-isolation --no-deps -e "$root")
    (cd / && "$py" -I -c "import offload._aio, offload._cpu_optim") # both extensions must have been built
    "$py" -I "$root/scripts/build_stamp.py" "$root" --write "$_zo_stamp"
    _zo_say "C++ extensions built in $(($(date +%s) - _zo_t0)) s"
fi
