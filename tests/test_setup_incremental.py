"""scripts/setup_env.sh rebuilds the C++ extensions only when a build input changed.

The decision is scripts/build_stamp.py's fingerprint: these tests change one input at a time in a scratch
copy of the build files and check which changes move it. The slow test runs setup_env.sh twice against a
scratch checkout and environment and checks that the second call builds nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "build_stamp.py")


def _load_build_stamp():
    spec = importlib.util.spec_from_file_location("build_stamp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_stamp = _load_build_stamp()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A scratch checkout with the real build files, C++ sources and one Python module."""
    for var in build_stamp.FLAG_VARS:
        monkeypatch.delenv(var, raising=False)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    for top in build_stamp.SOURCE_DIRS:
        shutil.copytree(os.path.join(ROOT, top), tmp_path / top)
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "tiers.py").write_text("X = 1\n")
    return tmp_path


def _edit(path, text: str = "// edited\n") -> None:
    with open(path, "a") as f:
        f.write(text)


def test_cpp_sources_headers_and_build_files_change_the_stamp(tree):
    base = build_stamp.fingerprint(str(tree))
    assert base == build_stamp.fingerprint(str(tree))  # deterministic
    seen = {base}
    for rel in ("aio_csrc/handle.cpp", "ops_csrc/kernels_impl.h", "setup.py", "pyproject.toml"):
        _edit(tree / rel, "\n# edited\n" if rel.endswith((".py", ".toml")) else "// edited\n")
        value = build_stamp.fingerprint(str(tree))
        assert value not in seen, f"editing {rel} left the stamp unchanged"
        seen.add(value)
    (tree / "ops_csrc" / "new_kernel.cpp").write_text("int f() { return 1; }\n")
    assert build_stamp.fingerprint(str(tree)) not in seen  # a new translation unit
    seen.add(build_stamp.fingerprint(str(tree)))
    (tree / "ops_csrc" / "new_kernel.cpp").rename(tree / "ops_csrc" / "renamed_kernel.cpp")
    assert build_stamp.fingerprint(str(tree)) not in seen  # same bytes, another file


def test_python_sources_timestamps_and_cpp_tests_do_not_change_the_stamp(tree):
    base = build_stamp.fingerprint(str(tree))
    _edit(tree / "offload" / "tiers.py", "Y = 2\n")
    (tree / "offload" / "new_module.py").write_text("Z = 3\n")
    _edit(tree / "ops_csrc" / "tests" / "lowbit_test.cpp")  # built by the test suite, not by setup
    later = time.time() + 100
    os.utime(tree / "aio_csrc" / "handle.cpp", (later, later))  # a touch without a change
    assert build_stamp.fingerprint(str(tree)) == base


@pytest.mark.parametrize("var", ["CXXFLAGS", "CFLAGS", "CPPFLAGS", "LDFLAGS"])
def test_compile_flags_change_the_stamp(tree, monkeypatch, var):
    base = build_stamp.fingerprint(str(tree))
    monkeypatch.setenv(var, "-O1")
    assert build_stamp.fingerprint(str(tree)) != base


def test_another_compiler_changes_the_stamp(tree, tmp_path_factory, monkeypatch):
    base = build_stamp.fingerprint(str(tree))
    fake = tmp_path_factory.mktemp("bin") / "g++"
    fake.write_text("#!/bin/sh\necho 'g++ (Fake) 99.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    first = build_stamp.fingerprint(str(tree))
    assert first != base
    fake.write_text("#!/bin/sh\necho 'g++ (Fake) 99.1'\n")  # same path, upgraded compiler
    assert build_stamp.fingerprint(str(tree)) != first


def test_check_names_what_is_missing(tree):
    stamp = tree / "stamp"
    assert build_stamp.stale_reason(str(tree), str(stamp)) == "no build recorded in this environment yet"
    assert build_stamp.main([str(tree), "--write", str(stamp)]) == 0
    assert stamp.read_text().strip() == build_stamp.fingerprint(str(tree))
    # The stamp matches, but the extensions were never built in this scratch tree.
    reason = build_stamp.stale_reason(str(tree), str(stamp))
    assert reason is not None and "_aio" in reason and "missing" in reason
    assert build_stamp.main([str(tree), "--check", str(stamp)]) == 1


def test_requirements_check(tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("# comment\npytest>=7  # the runner\n\n")
    assert build_stamp.missing_requirement(str(req)) is None
    req.write_text("pytest>=7\nzero-offload-surely-not-a-package==1.0\n")
    assert build_stamp.missing_requirement(str(req)) == "zero-offload-surely-not-a-package==1.0"
    req.write_text("pytest==0.0.1\n")
    missing = build_stamp.missing_requirement(str(req))
    assert missing is not None and missing.startswith("pytest==0.0.1 (installed: ")


def test_development_requirements_pin_torch_and_list_the_tools():
    path = os.path.join(ROOT, "scripts", "requirements-dev.txt")
    with open(path) as f:
        lines = {line.split("#", 1)[0].strip() for line in f} - {""}
    assert "torch==2.13.0" in lines  # an unpinned torch would pull a CUDA build
    names = {line.split("=")[0].split(">")[0] for line in lines}
    assert {"tqdm", "matplotlib", "safetensors", "transformers", "pybind11", "setuptools"} <= names
    assert "peft==0.21.2" in lines


@pytest.mark.slow  # builds both extensions once in a scratch checkout (minutes on 2 cores)
def test_second_setup_call_builds_nothing(tmp_path):
    if shutil.which("bash") is None or shutil.which("g++") is None:
        pytest.skip("needs bash and g++")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), checkout / name)
    for top in ("aio_csrc", "ops_csrc", "scripts", "offload", "zero"):
        shutil.copytree(
            os.path.join(ROOT, top), checkout / top, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    # A scratch venv that sees this environment's packages (so nothing is installed) through a .pth file:
    # the editable install and the stamp land in the scratch venv only.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    with open(os.path.join(purelib, "outer.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    env = dict(os.environ, ZO_VENV=str(venv))
    env.pop("PYTHONPATH", None)
    setup = ["bash", str(checkout / "scripts" / "setup_env.sh")]

    first = subprocess.run(setup, env=env, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "building the C++ extensions" in first.stderr
    built = sorted((checkout / "offload").glob("_*.so"))
    assert len(built) == 2
    mtimes = [p.stat().st_mtime_ns for p in built]

    _edit(checkout / "offload" / "__init__.py", "\n# a Python edit needs no rebuild\n")
    start = time.monotonic()
    second = subprocess.run(setup, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert second.returncode == 0, second.stderr[-4000:]
    assert "building" not in second.stderr and "installing" not in second.stderr, second.stderr
    assert [p.stat().st_mtime_ns for p in built] == mtimes
    assert elapsed < 20, f"second setup call took {elapsed:.1f} s"
