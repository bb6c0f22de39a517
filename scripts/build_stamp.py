"""Decides whether scripts/setup_env.sh has work to do: installing packages, rebuilding the C++ extensions.

The build fingerprint hashes everything the compiled extensions depend on: the C++ sources and headers
under aio_csrc/ and ops_csrc/ (their names and contents; the sanitizer programs in their tests/ folders
are built by the test suite, not by setup), setup.py and pyproject.toml, the compilers (path and
`--version` of the C and C++ compilers setuptools uses), the build flags taken from the environment, the
Python (version, ABI suffix, executable) and pybind11's version. Python sources are not inputs: the
editable install imports them from the tree.

    build_stamp.py ROOT                      print the fingerprint
    build_stamp.py ROOT --check STAMP        exit 0 when STAMP holds the fingerprint and both extensions
                                             and the editable install are in place; else exit 1, the
                                             reason on stderr
    build_stamp.py ROOT --write STAMP        write the fingerprint to STAMP
    build_stamp.py ROOT --requirements FILE  exit 0 when every requirement in FILE is installed; else
                                             exit 1, the first missing one on stderr

Standard library only (the requirement check uses `packaging` when it is installed): it runs before
anything else is, and in well under a second.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

SOURCE_DIRS = ("aio_csrc", "ops_csrc")
SOURCE_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".inc")
BUILD_FILES = ("setup.py", "pyproject.toml")
# Environment variables the compiler command lines depend on (read by setuptools/distutils).
FLAG_VARS = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "LDCXXSHARED", "ARCHFLAGS")
EXTENSIONS = ("_aio", "_cpu_optim")  # under offload/, one per setup.py extension


def source_files(root: str) -> list:
    """The C++ inputs, relative to root, sorted: every source and header of the extensions' folders."""
    files = []
    for top in SOURCE_DIRS:
        for name in sorted(os.listdir(os.path.join(root, top))):
            if name.endswith(SOURCE_SUFFIXES) and os.path.isfile(os.path.join(root, top, name)):
                files.append(f"{top}/{name}")
    return files


def _compiler_identity(var: str) -> str:
    """The compiler setuptools runs for `var` (CC or CXX): the environment's, else Python's build config."""
    command = os.environ.get(var) or sysconfig.get_config_var(var) or ""
    words = shlex.split(command)
    if not words:
        return f"{var}=<none>"
    path = shutil.which(words[0]) or words[0]
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError as exc:
        version = f"<cannot run: {exc}>"
    return f"{var}={command}\npath={os.path.realpath(path)}\n{version}"


def _pybind11_version() -> str:
    try:
        return importlib.metadata.version("pybind11")
    except importlib.metadata.PackageNotFoundError:
        return "<none>"


def fingerprint(root: str) -> str:
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    root = os.path.realpath(root)
    add("root", root.encode())
    for rel in [*source_files(root), *BUILD_FILES]:
        with open(os.path.join(root, rel), "rb") as f:
            add(rel, f.read())
    for var in FLAG_VARS:
        add(f"env:{var}", os.environ.get(var, "").encode())
    for var in ("CC", "CXX"):
        add(f"compiler:{var}", _compiler_identity(var).encode())
    add("python", f"{sys.version}\n{sysconfig.get_config_var('EXT_SUFFIX')}\n{sys.executable}".encode())
    add("pybind11", _pybind11_version().encode())
    return h.hexdigest()


def extension_paths(root: str) -> list:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return [os.path.join(root, "offload", name + suffix) for name in EXTENSIONS]


def stale_reason(root: str, stamp: str) -> str | None:
    """Why the extensions must be rebuilt, or None when the stamp and the installed build are current."""
    try:
        with open(stamp) as f:
            recorded = f.read().strip()
    except FileNotFoundError:
        return "no build recorded in this environment yet"
    for path in extension_paths(root):
        if not os.path.isfile(path):
            return f"{os.path.relpath(path, root)} is missing"
    try:
        importlib.metadata.distribution("zero-offload")
    except importlib.metadata.PackageNotFoundError:
        return "zero-offload is not installed in this environment"
    spec = importlib.util.find_spec("offload")
    origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
    if origin is None or not origin.startswith(os.path.realpath(root) + os.sep):
        return f"the installed offload package ({origin}) is not this checkout's"
    if recorded != fingerprint(root):
        return "a C++ source, a build file, a flag, the compiler or Python changed since the last build"
    return None


def missing_requirement(path: str) -> str | None:
    """The first requirement of the file that is not installed (or the reason it cannot be checked)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return "packaging (needed to check the others)"
    with open(path) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    for line in filter(None, lines):
        req = Requirement(line)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return line
        if not req.specifier.contains(version, prereleases=True):
            return f"{line} (installed: {version})"
    return None


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the checkout (the folder holding setup.py)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", metavar="STAMP", help="exit 0 when nothing needs rebuilding")
    mode.add_argument("--write", metavar="STAMP", help="record the current fingerprint")
    mode.add_argument("--requirements", metavar="FILE", help="exit 0 when FILE's requirements are installed")
    args = parser.parse_args(argv)
    root = os.path.realpath(args.root)
    if args.requirements:
        missing = missing_requirement(args.requirements)
        if missing is not None:
            print(f"not installed: {missing}", file=sys.stderr)
            return 1
        return 0
    if args.check:
        reason = stale_reason(root, args.check)
        if reason is not None:
            print(reason, file=sys.stderr)
            return 1
        return 0
    value = fingerprint(root)
    if args.write:
        tmp = f"{args.write}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(value + "\n")
        os.replace(tmp, args.write)
    else:
        print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
