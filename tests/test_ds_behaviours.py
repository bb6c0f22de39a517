"""DeepSpeed's documented call forms and behaviours: aio keyword forms, zero.Init without a config,
parameters returned from a module's forward at stage 3."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from offload.aio import AioHandle, FileInDir

SIZE = 1 << 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _payload(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g)


def _write_read(h: AioHandle, write_kw: dict, read_kw: dict, seed: int, offset: int) -> None:
    src = _payload(seed)
    dst = torch.zeros_like(src)
    assert h.async_pwrite(src, file_offset=offset, **write_kw) == 0
    assert h.wait() == 1
    assert h.async_pread(dst, file_offset=offset, **read_kw) == 0
    assert h.wait() == 1
    assert torch.equal(src, dst)


def test_aio_filename_keyword_round_trip(tmp_path):
    path = str(tmp_path / "by_name.bin")
    with AioHandle() as h:
        _write_read(h, {"filename": path}, {"filename": path}, seed=1, offset=0)
        # positional stays as before, and reads what the keyword form wrote
        _write_read(h, {"path_or_fd": path}, {"filename": path}, seed=2, offset=SIZE)
        assert h.sync_pwrite(_payload(3), filename=path) == 1
        back = torch.zeros(SIZE, dtype=torch.uint8)
        assert h.sync_pread(back, filename=path) == 1
        assert torch.equal(back, _payload(3))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:SIZE] == _payload(3).numpy().tobytes()
    assert data[SIZE:] == _payload(2).numpy().tobytes()


def test_aio_fd_keyword_round_trip(tmp_path):
    path = str(tmp_path / "by_fd.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with AioHandle() as h:
            _write_read(h, {"fd": fd}, {"fd": fd}, seed=4, offset=4096)
            src = _payload(5)
            assert h.pwrite(src, fd=fd, async_op=True) == 0
            assert h.wait() == 1
            back = torch.zeros_like(src)
            assert h.pread(back, fd=fd) == 1
            assert torch.equal(back, src)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        data = f.read()
    assert data[:SIZE] == _payload(5).numpy().tobytes()
    # the second write (at 0) covered all but the last 4096 bytes of the first (at 4096)
    assert len(data) == SIZE + 4096
    assert data[SIZE:] == _payload(4).numpy().tobytes()[SIZE - 4096 :]


def test_aio_file_of_a_directory_fd_round_trip(tmp_path):
    dir_fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        at = FileInDir(dir_fd, "in_dir.bin")
        with AioHandle() as h:
            _write_read(h, {"filename": at}, {"filename": at}, seed=6, offset=0)
    finally:
        os.close(dir_fd)
    with open(tmp_path / "in_dir.bin", "rb") as f:
        assert f.read() == _payload(6).numpy().tobytes()


@pytest.mark.parametrize(
    "op", ["async_pread", "async_pwrite", "sync_pread", "sync_pwrite", "pread", "pwrite"]
)
def test_aio_one_file_per_call(tmp_path, op):
    path = str(tmp_path / "x.bin")
    buf = torch.zeros(16, dtype=torch.uint8)
    with AioHandle() as h:
        call = getattr(h, op)
        with pytest.raises(TypeError, match="no file given"):
            call(buf)
        with pytest.raises(TypeError, match="filename and fd"):
            call(buf, filename=path, fd=0)
        with pytest.raises(TypeError, match="path_or_fd and filename"):
            call(buf, path, filename=path)
        with pytest.raises(TypeError, match="pass a descriptor as fd="):
            call(buf, filename=3)
        with pytest.raises(TypeError, match="fd must be an open file descriptor"):
            call(buf, fd=path)
        assert h.pending() == 0
    assert not os.path.exists(path)


def _run_child(code: str) -> str:
    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["PYTHONPATH"] = REPO
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_init_without_a_config_starts_a_one_process_group():
    out = _run_child(
        """
        import torch
        import torch.distributed as dist
        import zero

        assert not dist.is_initialized()
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        torch.manual_seed(0)
        with zero.Init():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert model[0].weight.numel() == 0  # partitioned
        with zero.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), plain.parameters()):
                assert torch.equal(p, q)
        print("ok", dist.get_backend())
        """
    )
    assert out.split() == ["ok", "gloo"]
