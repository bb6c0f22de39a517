"""Pinned host buffers and the capped pool: sizes, alignment, locking, CUDA registration order, accounting."""

from __future__ import annotations

import gc
import os
import resource
import threading
import warnings

import pytest
import torch

from offload import pinned
from offload.pinned import (
    ALIGNMENT,
    HostBuffer,
    MemlockLimitWarning,
    PinnedMemoryBudgetError,
    PinnedPool,
    pinned_bytes_in_use,
    pinned_tensor,
)
from tests.aio_helpers import run_child


def vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.fixture
def memlock_limit():
    """Set the soft RLIMIT_MEMLOCK for one test and re-arm the one-time warning; both restored afterwards."""
    saved = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    saved_flag = pinned._warned_memlock

    def set_soft(value: int) -> None:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (value, saved[1]))
        except ValueError as e:
            pytest.skip(f"cannot set RLIMIT_MEMLOCK to {value} under hard limit {saved[1]}: {e}")
        pinned._warned_memlock = False

    yield set_soft
    resource.setrlimit(resource.RLIMIT_MEMLOCK, saved)
    pinned._warned_memlock = saved_flag


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [1, 3, 1000, (2 << 20) + 1])
def test_pinned_tensor_exact_size_aligned_and_accounted(numel, dtype):
    before = pinned_bytes_in_use()
    t = pinned_tensor(numel, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    assert t.untyped_storage().nbytes() == numel * itemsize  # exact, no power-of-two rounding
    assert pinned_bytes_in_use() - before == numel * itemsize
    t.fill_(1)
    assert int(t[-1]) == 1
    del t
    assert pinned_bytes_in_use() == before


def test_zero_elements():
    t = pinned_tensor(0, torch.float32)
    assert t.numel() == 0
    with pytest.raises(ValueError, match="numel must be >= 0"):
        pinned_tensor(-1, torch.float32)


def test_views_keep_the_memory_alive():
    gc.collect()  # an earlier test's unreachable pinned buffers must not be freed inside the measurement
    before = pinned_bytes_in_use()
    t = pinned_tensor(4096, torch.int32)
    t.copy_(torch.arange(4096, dtype=torch.int32))
    view = t[100:].view(torch.uint8)
    del t
    gc.collect()
    assert pinned_bytes_in_use() - before == 4096 * 4  # still referenced by the view
    assert torch.equal(view.view(torch.int32), torch.arange(100, 4096, dtype=torch.int32))
    del view
    assert pinned_bytes_in_use() == before


def test_buffer_is_locked_when_the_limit_allows(memlock_limit):
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard != resource.RLIM_INFINITY and hard < 4 << 20:
        pytest.skip(f"RLIMIT_MEMLOCK hard limit {hard} bytes is below the 3 MiB this test locks")
    memlock_limit(hard)
    locked_before = vm_locked_kib()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemlockLimitWarning)
        buf = pinned.alloc_host_buffer(3 << 20)
    assert buf.locked
    assert vm_locked_kib() - locked_before >= 3 << 10  # measured by the kernel, not our own bookkeeping
    buf.release()
    assert vm_locked_kib() == locked_before


def test_unlocked_with_one_warning_naming_the_limit():
    # In a child: root (CAP_IPC_LOCK) may lock past RLIMIT_MEMLOCK, so the child drops to an ordinary user.
    result = run_child(
        """
        import os, resource, warnings, torch
        from offload import pinned
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            a = pinned.alloc_host_buffer(4 << 20)
            b = pinned.pinned_tensor(1 << 20, torch.float32)
            c = pinned.alloc_host_buffer(4096)
        b.fill_(2.0)  # unlocked memory still works
        msgs = [str(w.message) for w in rec if issubclass(w.category, pinned.MemlockLimitWarning)]
        result = {"msgs": msgs, "locked": [a.locked, c.locked], "sum": float(b.sum())}
        """
    )
    assert "exc" not in result, result
    assert len(result["msgs"]) == 1, result["msgs"]
    text = result["msgs"][0]
    assert "RLIMIT_MEMLOCK is 64 KiB" in text and "ulimit -l" in text and "limits.conf" in text
    assert result["locked"][0] is False
    assert result["sum"] == 2.0 * (1 << 20)


def test_release_is_idempotent_and_views_refuse_after():
    before = pinned_bytes_in_use()
    buf = HostBuffer(10_000, cudart=None)
    assert not buf.released and buf.ptr % ALIGNMENT == 0
    buf.release()
    buf.release()
    assert buf.released and pinned_bytes_in_use() == before
    with pytest.raises(ValueError, match="already released"):
        buf.as_ctypes()
    with pytest.raises(ValueError, match="must be positive"):
        HostBuffer(0)


class FakeCudart:
    """Records cudaHostRegister/Unregister and what was still allocated when Unregister ran."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = []
        self.fail = fail

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr, pinned_bytes_in_use()))
        return 0


def test_cuda_registration_undone_before_free():
    cudart = FakeCudart()
    before = pinned_bytes_in_use()
    buf = HostBuffer(5 << 20, cudart=cudart)
    assert buf.cuda_registered
    assert cudart.calls == [("register", buf.ptr, 5 << 20, 0)]
    ptr = buf.ptr
    t = torch.frombuffer(buf.as_ctypes(), dtype=torch.uint8)
    del buf
    assert len(cudart.calls) == 1  # the tensor still holds the buffer
    del t
    # Unregistered while the memory was still allocated (accounted), then freed.
    assert cudart.calls[1] == ("unregister", ptr, before + (5 << 20))
    assert pinned_bytes_in_use() == before


def test_cuda_registration_failure_frees_the_buffer():
    before = pinned_bytes_in_use()
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4096 bytes"):
        HostBuffer(4096, cudart=FakeCudart(fail=True))
    assert pinned_bytes_in_use() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_registration():
    t = pinned_tensor(1 << 20, torch.float32)
    assert t.is_pinned()
    d = t.fill_(3.0).cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert float(d.sum()) == 3.0 * (1 << 20)


# -- PinnedPool --------------------------------------------------------------------------------------------


def test_pool_accounting_and_cap():
    pool = PinnedPool(1 << 20)
    before = pinned_bytes_in_use()
    a = pool.allocate(100_000, torch.float32)  # 400 000 bytes
    b = pool.allocate(300_000, torch.uint8)
    assert pool.bytes_in_use == 700_000 and pool.peak_bytes == 700_000 and pool.cap_bytes == 1 << 20
    assert pinned_bytes_in_use() - before == 700_000
    with pytest.raises(PinnedMemoryBudgetError) as info:
        pool.allocate(100_000, torch.float32)
    err = info.value
    assert (err.requested, err.in_use, err.cap) == (400_000, 700_000, 1 << 20)
    assert (
        "requested 400000 bytes" in str(err)
        and "700000 bytes in use" in str(err)
        and "cap 1048576" in str(err)
    )
    assert pool.bytes_in_use == 700_000  # a refused request charges nothing
    pool.free(a)
    assert pool.bytes_in_use == 300_000 and pool.peak_bytes == 700_000
    c = pool.allocate(187_144, torch.float32)  # exactly up to the cap
    assert pool.bytes_in_use == 1 << 20
    pool.free(b)
    pool.free(c)
    assert pool.bytes_in_use == 0
    del a, b, c
    assert pinned_bytes_in_use() == before


def test_pool_rejects_foreign_and_double_free():
    pool = PinnedPool(1 << 20)
    t = pool.allocate(10, torch.float32)
    with pytest.raises(ValueError, match="not allocated by this PinnedPool"):
        pool.free(torch.empty(10))
    pool.free(t)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(t)
    with pytest.raises(ValueError, match="numel must be positive"):
        pool.allocate(0, torch.float32)
    with pytest.raises(ValueError, match="cap_bytes"):
        PinnedPool(-1)


def test_pool_pins_only_the_asked_range(memlock_limit):
    """A partly pinned tensor: one buffer, only the whole pages around [start, end) locked and charged."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard != resource.RLIM_INFINITY and hard < 4 << 20:
        pytest.skip(f"RLIMIT_MEMLOCK hard limit {hard} bytes is below the 1 MiB this test locks")
    memlock_limit(hard)
    page = pinned.PAGE_BYTES
    numel, start = 1 << 18, 100_000  # 1 MiB of fp32, pinned from element 100 000 on
    charged = numel * 4 - start * 4 // page * page
    pool = PinnedPool(1 << 30)
    before, locked0 = pinned_bytes_in_use(), vm_locked_kib()
    t = pool.allocate_partly(numel, torch.float32, start, numel)
    assert t.shape == (numel,) and torch.count_nonzero(t) == 0
    assert pool.bytes_in_use == charged == pinned_bytes_in_use() - before < numel * 4
    t.fill_(1.0)  # every page faulted in: the locked ones lock now
    assert (vm_locked_kib() - locked0) << 10 == charged  # measured by the kernel
    pool.free(t)
    del t
    gc.collect()
    assert pool.bytes_in_use == 0 and pinned_bytes_in_use() == before and vm_locked_kib() == locked0
    mid = pool.allocate_partly(numel, torch.float32, 1, 2)  # one element: its one page
    assert pool.bytes_in_use == page
    pool.free(mid)
    with pytest.raises(PinnedMemoryBudgetError):
        PinnedPool(charged - 1).allocate_partly(numel, torch.float32, start, numel)
    with pytest.raises(ValueError, match="lock_range"):
        pool.allocate_partly(numel, torch.float32, 0, numel + 1)


def test_partly_pinned_buffer_registers_only_its_range_with_cuda():
    cudart = FakeCudart()
    before = pinned_bytes_in_use()
    page = pinned.PAGE_BYTES
    buf = HostBuffer(8 * page, cudart=cudart, lock_range=(3 * page + 1, 5 * page - 1))
    assert (buf.pinned_range, buf.pinned_nbytes) == ((3 * page, 5 * page), 2 * page)
    assert cudart.calls == [("register", buf.ptr + 3 * page, 2 * page, 0)]
    assert pinned_bytes_in_use() - before == 2 * page
    ptr = buf.ptr
    buf.release()
    assert cudart.calls[1] == ("unregister", ptr + 3 * page, before + 2 * page)
    assert pinned_bytes_in_use() == before


def test_pool_is_thread_safe_and_never_exceeds_cap():
    cap = 4 << 20
    pool = PinnedPool(cap)
    errors, refused = [], []
    observed_max = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        held = []
        try:
            for _ in range(60):
                if held and torch.rand((), generator=g) < 0.45:
                    pool.free(held.pop(int(torch.randint(len(held), (), generator=g))))
                    continue
                n = int(torch.randint(1, 400_000, (), generator=g))
                try:
                    held.append(pool.allocate(n, torch.uint8))
                except PinnedMemoryBudgetError as e:
                    assert e.requested + e.in_use > e.cap
                    refused.append(n)
                with lock:
                    observed_max[0] = max(observed_max[0], pool.bytes_in_use)
            for t in held:
                pool.free(t)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.bytes_in_use == 0
    assert observed_max[0] <= cap and pool.peak_bytes <= cap
    assert pool.peak_bytes >= observed_max[0] > 0
    assert refused, "the workload is sized to hit the cap"


# ------------------------------------------------------------------------------- when pages fault in
def resident_bytes(ptr: int) -> int:
    """Resident bytes of the mapping holding address `ptr` (/proc/self/smaps): the buffer's own pages,
    unlike the process RSS, which other threads' frees and allocations move at the same time."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {ptr:#x}")


def has_cap_ipc_lock() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)  # CAP_IPC_LOCK ignores RLIMIT_MEMLOCK
    return False


@pytest.fixture
def lockable(memlock_limit):
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard != resource.RLIM_INFINITY and hard < 256 << 20 and not has_cap_ipc_lock():
        pytest.skip(f"RLIMIT_MEMLOCK hard limit {hard} bytes is below the 256 MiB these tests lock")
    memlock_limit(hard)


@pytest.mark.parametrize("mode", ["sync", "background", "none"])
def test_populate_modes_lock_at_once_and_fault_in_when_asked(mode, lockable):
    n = 64 << 20
    locked0 = vm_locked_kib()
    buf = pinned.alloc_host_buffer(n, populate=mode)
    try:
        assert buf.locked
        assert vm_locked_kib() - locked0 >= n >> 10  # the whole range is locked now, in every mode
        if mode == "background":
            buf.wait_populated()
        grown = resident_bytes(buf.ptr)
        if mode == "none" and not buf.cuda_registered:
            assert not buf.populated and grown < n // 4  # nothing faulted in until touched
        else:  # cudaHostRegister (on a CUDA host) faults in every page whatever the mode
            assert buf.populated and grown >= n  # every page resident, measured by the kernel
        arr = (torch.frombuffer(buf.as_ctypes(), dtype=torch.uint8)).view(torch.int64)
        assert int(arr.abs().sum()) == 0  # a fresh buffer reads as zeros
    finally:
        buf.release()
    assert vm_locked_kib() == locked0


def test_background_population_never_changes_what_the_owner_wrote(lockable):
    n = 128 << 20  # several population slices
    buf = pinned.alloc_host_buffer(n, populate="background")
    t = torch.frombuffer(buf.as_ctypes(), dtype=torch.int32)
    expected = torch.arange(t.numel(), dtype=torch.int32)
    t.copy_(expected)  # races the population thread on purpose
    buf.wait_populated()
    assert buf.populated
    assert torch.equal(t, expected)
    del t
    gc.collect()
    buf.release()


def test_release_while_populating_stops_the_thread_and_frees_everything(lockable):
    before, locked0 = pinned_bytes_in_use(), vm_locked_kib()
    for _ in range(3):
        buf = pinned.alloc_host_buffer(256 << 20, populate="background")
        buf.release()  # joins the population thread before unmapping
        assert buf.released
    assert pinned_bytes_in_use() == before
    assert vm_locked_kib() == locked0
    with pytest.raises(ValueError, match="already released"):
        buf.wait_populated()


def test_pool_tensors_are_zero_and_charged_before_their_pages_fault_in(lockable):
    pool = PinnedPool(1 << 30)
    t = pool.allocate(8 << 20, torch.float32)  # background population by default
    assert pool.bytes_in_use == 32 << 20
    assert torch.count_nonzero(t) == 0
    lazy = pool.allocate(1 << 20, torch.float64, populate="none")
    assert pool.bytes_in_use == 40 << 20 and torch.count_nonzero(lazy) == 0
    pool.free(t)
    pool.free(lazy)
    assert pool.bytes_in_use == 0


def test_bad_populate_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="populate must be one of .*'eager'"):
        HostBuffer(4096, populate="eager")  # type: ignore[arg-type]
    from offload import _aio

    with pytest.raises(Exception, match="populate must be 'sync', 'background' or 'none', got 'eager'"):
        _aio.alloc_pinned(4096, populate="eager")


def test_small_background_buffers_are_populated_before_returning(lockable):
    buf = pinned.alloc_host_buffer(1 << 20, populate="background")  # one slice: no thread for it
    assert buf.locked and buf.populated
    buf.release()


# --- the automatic pinned budget: cgroup limit and processes per node -----------------------------------

GiB = 1 << 30


def fake_cgroup(tmp_path, files: dict, membership: str = "0::/\n"):
    """A fake /sys/fs/cgroup tree (`files`: path under the root -> contents) and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(membership)
    return str(root), str(self_cgroup)


@pytest.mark.parametrize(
    "files, membership, expected",
    [
        ({"memory.max": f"{8 * GiB}\n"}, "0::/\n", 8 * GiB),  # v2, inside a container
        ({"memory.max": "max\n"}, "0::/\n", None),
        ({"memory/memory.limit_in_bytes": f"{4 * GiB}\n"}, "4:memory:/\n", 4 * GiB),  # v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, "4:memory:/\n", None),  # v1 "unlimited"
        ({}, "0::/\n", None),
        ({"memory.max": "garbage\n"}, "0::/\n", None),
        # v2 on a host: the limit sits on an ancestor of the process's own cgroup (e.g. a batch job)
        ({"job/memory.max": f"{2 * GiB}", "job/step/memory.max": "max"}, "0::/job/step\n", 2 * GiB),
        ({"job/memory.max": f"{6 * GiB}", "job/step/memory.max": f"{3 * GiB}"}, "0::/job/step\n", 3 * GiB),
        # v1 with the memory controller among others, limit on the process's own cgroup
        (
            {
                "memory/a/memory.limit_in_bytes": f"{GiB}",
                "memory/memory.limit_in_bytes": "9223372036854771712",
            },
            "5:cpu,memory:/a\n",
            GiB,
        ),
        # a cgroup outside this namespace ("/.."): only the root is read
        ({"memory.max": f"{5 * GiB}"}, "0::/../../elsewhere\n", 5 * GiB),
    ],
)
def test_cgroup_memory_limit(tmp_path, files, membership, expected):
    root, self_cgroup = fake_cgroup(tmp_path, files, membership)
    assert pinned.cgroup_memory_limit(root, self_cgroup) == expected


def test_cgroup_memory_limit_without_proc_self_cgroup(tmp_path):
    root, _ = fake_cgroup(tmp_path, {"memory.max": f"{GiB}"})
    assert pinned.cgroup_memory_limit(root, str(tmp_path / "missing")) == GiB


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 1),
        ({"LOCAL_WORLD_SIZE": "4"}, 4),
        ({"LOCAL_SIZE": "8"}, 8),  # DeepSpeed's launcher
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "8"}, 4),
        ({"LOCAL_WORLD_SIZE": "0"}, 1),
        ({"LOCAL_WORLD_SIZE": "many", "LOCAL_SIZE": "3"}, 3),
    ],
)
def test_local_world_size(env, expected):
    assert pinned.local_world_size(env) == expected


def test_automatic_budget_is_half_the_usable_memory_shared_by_the_local_processes(tmp_path):
    root, self_cgroup = fake_cgroup(tmp_path, {"memory.max": f"{16 * GiB}"})
    budget = pinned.automatic_pinned_budget(
        physical=64 * GiB, cgroup_root=root, self_cgroup=self_cgroup, environ={"LOCAL_WORLD_SIZE": "4"}
    )
    assert budget == 16 * GiB // 2 // 4
    # A cgroup limit above physical memory changes nothing; no launcher variables: one process.
    root2, self2 = fake_cgroup(tmp_path / "b", {"memory.max": f"{128 * GiB}"})
    budget = pinned.automatic_pinned_budget(
        physical=64 * GiB, cgroup_root=root2, self_cgroup=self2, environ={}
    )
    assert budget == 32 * GiB


def test_default_budget_uses_cgroup_and_local_world_size(tmp_path, monkeypatch):
    root, self_cgroup = fake_cgroup(tmp_path, {"memory.max": f"{12 * GiB}"})
    monkeypatch.setattr(pinned, "CGROUP_ROOT", root)
    monkeypatch.setattr(pinned, "PROC_SELF_CGROUP", self_cgroup)
    monkeypatch.setattr(pinned, "physical_memory_bytes", lambda: 256 * GiB)
    monkeypatch.delenv(pinned.PINNED_BUDGET_ENV, raising=False)
    for name in pinned.LOCAL_WORLD_SIZE_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert pinned.default_pinned_budget() == 12 * GiB // 2 // 3
    # An explicit budget is per process and taken as given: the config key, then the environment variable.
    monkeypatch.setenv(pinned.PINNED_BUDGET_ENV, str(5 * GiB))
    assert pinned.default_pinned_budget() == 5 * GiB
    assert pinned.default_pinned_budget(7 * GiB) == 7 * GiB


def test_default_budget_on_this_machine_is_at_most_half_of_physical_memory(monkeypatch):
    monkeypatch.delenv(pinned.PINNED_BUDGET_ENV, raising=False)
    budget = pinned.default_pinned_budget()
    assert 0 < budget <= pinned.physical_memory_bytes() // 2


def test_default_budget_is_shared_by_the_processes_of_the_node(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE divides the default: 4 ranks on a node no longer each take half of it."""
    monkeypatch.delenv(pinned.PINNED_BUDGET_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < pinned.default_pinned_budget() <= physical // 2 // 4
