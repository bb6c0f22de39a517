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


class _Returns(torch.nn.Module):
    """A module whose forward returns its own parameter (DeepSpeed calls it a dangling parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 6))

    def forward(self) -> torch.Tensor:
        return self.weight


class _Middle(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Returns()

    def forward(self) -> tuple:
        return self.inner(), 2.0  # handed on again, inside a tuple


class _UsesReturned(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _Returns()
        self.middle = _Middle()
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj()  # the caller multiplies by it
        # as in torch, the caller gets the parameter itself (autograd saves it, so backward gathers it again)
        assert w is self.proj.weight
        h = torch.tanh(x @ w)
        w2, scale = self.middle()
        return self.head(h * scale + (x @ w2))


def _stage3_config(param: str, tmp) -> dict:
    zo: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if param != "none":
        zo["offload_param"] = {"device": param, "nvme_path": str(tmp), "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zo,
    }


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_parameter_returned_from_forward_is_whole_for_the_caller(tmp_path, param):
    import zero
    from zero.utils import safe_get_full_grad

    torch.manual_seed(0)
    plain = _UsesReturned()
    model = _UsesReturned()
    model.load_state_dict(plain.state_dict())
    engine, *_ = zero.initialize(model=model, config=_stage3_config(param, tmp_path))
    try:
        assert all(p.numel() == 0 for p in engine.module.parameters())
        for step in range(2):  # the first pass learns the use, the second runs with it known
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            want = plain(x)
            got = engine(x)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            plain.zero_grad()
            want.square().sum().backward()
            engine.backward(got.square().sum())
            for (name, p), q in zip(engine.module.named_parameters(), plain.parameters()):
                torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-6, msg=name)
            engine.step()  # zeroes the engine's gradients; the plain model's weights stay as they are
            with zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
                for p, q in zip(engine.module.parameters(), plain.parameters()):
                    p.data.copy_(q.data)
        assert all(p.numel() == 0 for p in engine.module.parameters())  # released after the pass
        with torch.no_grad():
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
            torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=1e-6)
    finally:
        engine.close()


def _init_config(checks: bool, persistence: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "enable_sanity_checks": checks,
            "stage3_param_persistence_threshold": persistence,
        },
    }


def _values(model: torch.nn.Module) -> list:
    import zero

    with zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("persistence", [0, 10**6], ids=["partitioned", "persistent"])
@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.add_(1.0),  # on the parameter (its version counter moves)
        lambda p: p.data.mul_(2.0),  # through .data (no version counter sees it)
        lambda p: setattr(p, "data", torch.ones_like(p)),  # .data replaced
    ],
    ids=["inplace", "data-inplace", "data-replaced"],
)
def test_sanity_checks_report_a_change_without_modifier_rank(persistence, change):
    import zero

    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=_init_config(True, persistence)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = _values(model)
    with pytest.raises(
        RuntimeError, match=r"modifier_rank=None \(\S*Linear\.weight\); the changes are discarded"
    ):
        with zero.GatheredParameters(model[0].weight), torch.no_grad():
            change(model[0].weight)
    after = _values(model)  # the change is discarded, as DeepSpeed documents
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # a block that changes nothing passes; with modifier_rank the change is kept and not reported
    with zero.GatheredParameters(list(model.parameters())):
        pass
    with zero.GatheredParameters(model[0].weight, modifier_rank=0), torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(_values(model)[0], before[0] + 1.0)


def _sanity_on_ranks(rank: int, world_size: int, nvme_dir: str, out_dir: str) -> tuple:
    import zero

    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=_init_config(True, 0)):
        model = torch.nn.Linear(4, 3)
    before = _values(model)
    message = None
    try:
        with zero.GatheredParameters(model.weight), torch.no_grad():
            if rank == 1:  # only one rank changes it: every rank must raise, or they would diverge
                model.weight.add_(1.0)
    except RuntimeError as e:
        message = str(e)
    return message, all(torch.equal(a, b) for a, b in zip(before, _values(model)))


def test_sanity_checks_raise_on_every_rank(tmp_path):
    from dist_helpers import run_on_ranks

    (msg0, same0), (msg1, same1) = run_on_ranks(_sanity_on_ranks, tmp_path)[0]
    assert msg0 is not None and "(on another rank)" in msg0
    assert msg1 is not None and "Linear.weight" in msg1
    assert same0 and same1
