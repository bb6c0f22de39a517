"""Shared by the optimizer-state tests: split-state configs, the weights and states of an engine compared
bit for bit, a swapper whose n-th write fails, and a stage-3 parameter write that fails."""

from __future__ import annotations

import errno
import math

import pytest
import torch
from engine_helpers import base_config

import zero
from offload.aio import AioHandle

SUB = 4096  # sub_group_size: about 11 sub-groups for the tiny GPT


MICRO = 8  # micro-batches per run: 4 optimizer steps at gradient_accumulation_steps 2


def config(
    offload: str, tmp, stage: int, ratio: float = 1.0, max_in_cpu=0, fp16: bool = True, clip=0.5, **extra
):
    cfg = base_config(
        offload, tmp, stage=stage, gradient_accumulation_steps=2, gradient_clipping=clip, **extra
    )
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    zo = cfg["zero_optimization"]
    zo["sub_group_size"] = SUB
    zo["offload_optimizer"]["ratio"] = ratio
    if offload == "nvme":
        zo["offload_optimizer"]["max_in_cpu"] = max_in_cpu
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
    return cfg


def device_share(numel: int, ratio: float) -> int:
    """Twin-Flow: ceil(ratio x sub-groups) offloaded, the sub-groups before them on the device."""
    n_sub = math.ceil(numel / SUB)
    return min(numel, (n_sub - math.ceil(ratio * n_sub)) * SUB)


def weights(engine) -> dict:
    return {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def fail_nth_write(swapper, nth: int) -> dict:
    """From now on, the nth chunk write the swapper queues writes only its first half and the next wait on
    its handle reports EIO naming the swap file: a torn write. Returns a dict that records it firing."""
    fired: dict = {}
    count = [0]
    for h in swapper._handles:
        real_write = h.async_pwrite

        def write(buf, path, offset=0, h=h, real_write=real_write):
            count[0] += 1
            if count[0] != nth:
                return real_write(buf, path, offset)
            half = buf.view(torch.uint8)[: buf.numel() * buf.element_size() // 2]
            res = real_write(half, path, offset)
            real_wait = h.wait
            name = getattr(path, "path", path)  # a SwapFile: the core's errors name its path

            def failing_wait():
                real_wait()
                del h.wait  # once
                raise OSError(errno.EIO, "injected write failure", name)

            h.wait = failing_wait
            fired.update(path=name, offset=offset)
            return res

        h.async_pwrite = write
    return fired


class ParamWriteFault:
    """From arming on, the `nth` asynchronous write to a parameter swap file writes nothing and the next
    wait on its handle reports EIO naming the file; the next `sync_failures` synchronous writes to that file
    report EIO too (a disk that keeps refusing it). Patches AioHandle itself: the handles are the store's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nth: int, sync_failures: int = 0) -> None:
        self.nth, self.sync_failures = nth, sync_failures
        self.count = 0
        self.target = ""
        self.sync_refused = 0
        real_async, real_sync = AioHandle.async_pwrite, AioHandle.sync_pwrite
        fault = self

        def async_pwrite(h, buf, path=None, file_offset=0, **kw):
            if str(getattr(path, "name", "")).endswith(".param.swp"):
                fault.count += 1
                if fault.count == fault.nth:
                    fault.target = path.path
                    real_wait = h.wait

                    def failing_wait():
                        del h.wait  # once
                        real_wait()
                        raise OSError(errno.EIO, "injected write failure", path.path)

                    h.wait = failing_wait
                    return 0  # nothing written: the file keeps the previous step's weights
            return real_async(h, buf, path, file_offset, **kw)

        def sync_pwrite(h, buf, path=None, file_offset=0, **kw):
            if fault.target and getattr(path, "path", None) == fault.target and fault.sync_failures > 0:
                fault.sync_failures -= 1
                fault.sync_refused += 1
                raise OSError(errno.EIO, "injected write failure", path.path)
            return real_sync(h, buf, path, file_offset, **kw)

        monkeypatch.setattr(AioHandle, "async_pwrite", async_pwrite)
        monkeypatch.setattr(AioHandle, "sync_pwrite", sync_pwrite)
