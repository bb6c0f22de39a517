"""ZeroEngine: DeepSpeed's training-engine face (forward, backward, step, checkpoints) over ZeRO 0-2.

One step, on one rank:

1. forward / backward run on the model as the user wrote it. Its trainable parameters are views of one flat
   buffer and their `.grad`s views of a flat gradient buffer (zero.partition), so autograd accumulates every
   gradient directly into its final place.
2. On the backward that ends an accumulation window, post-accumulate-grad hooks send full buckets to the
   other ranks while backward goes on (overlap_comm); stages 1-2 reduce each bucket only to the ranks owning
   it. The rank's gradient partition is then copied once to the fp32 host tier (on a CPU-only machine with
   fp32 weights the gradient buffer is already that tier and nothing is copied).
3. The optimizer pass walks the partition chunk by chunk: the fused CPU kernel unscales (loss scale, world
   size, clipping coefficient in one `grad_scale`), updates master + states and writes the new 16-bit
   weights; the chunk is copied to the device parameter buffer. With NVMe, states stream through pinned
   slots (offload.swap.OptimizerSwapper) and the pass is committed only when every chunk succeeded.
4. Stages 1-2 all-gather the updated partitions.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from offload.estimate.formulas import MIN_SLOT_NUMEL, swap_chunk
from offload.pinned import (
    PINNED_BUDGET_ENV,
    PinnedMemoryBudgetError,
    PinnedPool,
    default_pinned_budget,
    pinned_bytes_in_use,
)
from offload.swap.optimizer_swapper import OptimizerSwapper, slot_bytes
from offload.swap.space import SwapSpace, check_nvme_path
from zero.accelerator import compute_device, dist_backend
from zero.comm import settle
from zero.errors import StateCorruptedError
from zero.grad_fetch import DeviceGradFetch, copy_to_host
from zero.optimizer_offload import (
    DeviceState,
    UpdateRule,
    ZeroOptimizer,
    rule_from_client_optimizer,
    rule_from_config,
)
from zero.partition import FlatParams, GradReadiness, GradReducer, partition_range
from zero.report import PhaseClock, StepReport

__all__ = ["PINNED_BUDGET_ENV", "ZeroEngine"]

# Cap on pinned host memory the engine may take (bytes). Until the config has a key for it, the
# environment sets it; default: half of the usable memory (RAM or cgroup limit) per local process.


def _describe(err: BaseException) -> str:
    """An error as its type and text; for an OSError also errno and path when the text lacks them."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError):
        if err.errno is not None and f"Errno {err.errno}" not in text:
            text += f" [errno {err.errno}]"
        if err.filename and str(err.filename) not in text:
            text += f" ({err.filename})"
    return text


def init_distributed() -> Tuple[int, int, int]:
    """(rank, world_size, local_rank): uses an initialized process group, or starts one under torchrun."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = dist_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        return dist.get_rank(), dist.get_world_size(), local_rank
    return 0, 1, local_rank


class _ParamWriter:
    """Moves updated master values of a chunk into the model's flat parameter buffer.

    CPU device: the kernel writes 16-bit weights straight into the parameter buffer (param_copy), fp32 is a
    plain copy, and when the master *is* the parameter buffer there is nothing to do. CUDA: the kernel
    writes into a pinned staging slot, copied asynchronously on a side stream; a slot is reused only after
    its copy finished (an event per slot).
    """

    def __init__(
        self, flat: FlatParams, lo: int, aliased: bool, chunk_numel: int, pool: Optional[PinnedPool]
    ):
        self.target = flat.param_buffer
        self.lo = lo
        self.aliased = aliased
        self.half = self.target.dtype != torch.float32
        self.cuda = self.target.is_cuda
        self.h2d_bytes = 0
        self._slot = 0
        self._staging: List[torch.Tensor] = []
        if self.cuda and not aliased:
            n_slots = 2
            for _ in range(n_slots):
                if pool is not None:
                    self._staging.append(pool.allocate(chunk_numel, self.target.dtype))
                else:
                    self._staging.append(torch.empty(chunk_numel, dtype=self.target.dtype).pin_memory())
            self._events = [torch.cuda.Event() for _ in range(n_slots)]
            self._stream = torch.cuda.Stream(device=self.target.device)
        self._pool = pool

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """Where the kernel should write 16-bit weights for this chunk (None: it writes none)."""
        if self.aliased:
            return None
        if self.cuda:
            self._slot = (self._slot + 1) % len(self._staging)
            self._events[self._slot].synchronize()
            return self._staging[self._slot][:n] if self.half else None
        return self.target[self.lo + start : self.lo + start + n] if self.half else None

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        if self.aliased:
            return
        dst = self.target[self.lo + start : self.lo + start + n]
        self.h2d_bytes += n * dst.element_size()
        if not self.cuda:
            if not self.half:
                dst.copy_(master)
            return
        src = self._staging[self._slot][:n]
        if not self.half:
            src.copy_(master)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            self._events[self._slot].record(self._stream)

    def finish(self) -> None:
        """Make the compute stream wait for the parameter copies of this step."""
        if self.cuda and not self.aliased:
            torch.cuda.current_stream(self.target.device).wait_stream(self._stream)

    def close(self) -> None:
        if self.cuda and not self.aliased:
            self._stream.synchronize()
        if self._pool is not None:
            for t in self._staging:
                self._pool.free(t)
        self._staging = []


class ZeroEngine:
    """What `zero.initialize` returns. Method names and semantics follow DeepSpeed's DeepSpeedEngine."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Any,
        *,
        optimizer: Optional[Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]] = None,
        model_parameters: Optional[Any] = None,
        lr_scheduler: Optional[Any] = None,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
    ) -> None:
        self.config = cfg
        self.rank, self.world_size = rank, world_size
        self.device = compute_device(local_rank)
        zcfg = cfg.zero_optimization
        self.stage = int(zcfg.stage)
        if self.stage > 3:
            raise ValueError(f"zero_optimization.stage={self.stage}: stages 0, 1, 2 and 3 exist")
        if self.stage < 3 and zcfg.offload_param is not None and zcfg.offload_param.device != "none":
            raise ValueError(
                f"zero_optimization.offload_param.device={zcfg.offload_param.device!r} needs stage 3; "
                "with stages 0-2 only offload_optimizer is supported"
            )
        off = zcfg.offload_optimizer
        self.offload_device = off.device if off is not None else "none"
        self.gas = int(cfg.gradient_accumulation_steps)
        self.micro_batch_size = int(cfg.train_micro_batch_size_per_gpu)
        self.train_batch_size_ = int(cfg.train_batch_size)
        self.gradient_clipping = float(cfg.gradient_clipping or 0.0)
        self.fp16 = bool(cfg.fp16.enabled)
        self.bf16 = bool(cfg.bf16.enabled)
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
        self.report_enabled = bool(cfg.zero_offload.report or cfg.wall_clock_breakdown)
        self.report_every = int(getattr(cfg.zero_offload, "report_every", 1) or 1)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_report: Optional[StepReport] = None
        self.last_grad_norm: Optional[float] = None  # set when a step computes it (clipping, fp16 check)
        self._closed = False
        # The first failure that may have left master, states or parameters inconsistent (None: usable);
        # `_state_error_what` says what failed. Steps and saves refuse until a checkpoint is loaded.
        self._state_error: Optional[BaseException] = None
        self._state_error_what = ""
        self._pass_updates = 0  # chunks the running optimizer pass updated (an in-place tier is torn then)
        self._space: Optional[SwapSpace] = None
        self._state: Any = None
        self._writer: Optional[_ParamWriter] = None
        self._torch_opt: Optional[torch.optim.Optimizer] = None
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        self._clock = PhaseClock(sync if self.report_enabled else None)

        # -- optimizer rule: from the config's optimizer block or the client optimizer, not both (DeepSpeed)
        params = self._trainable_params(model, model_parameters)
        client_opt = optimizer
        if cfg.optimizer is not None and client_opt is not None:
            raise ValueError(
                "both a client optimizer (optimizer=) and an 'optimizer' block in the config were given; "
                "keep one of them"
            )
        if cfg.optimizer is not None:
            rule, hyper = rule_from_config(cfg.optimizer.type, dict(cfg.optimizer.params))
        elif client_opt is not None:
            if callable(client_opt) and not isinstance(client_opt, torch.optim.Optimizer):
                client_opt = client_opt(params)
            rule, hyper = rule_from_client_optimizer(client_opt)
        else:
            raise ValueError("no optimizer: give an 'optimizer' block in the config or pass optimizer=")
        self.rule: UpdateRule = rule
        if self.stage == 3:
            self._setup_stage3(model, params, hyper, off)  # zero/stage3_engine.py
        else:
            self._setup_flat(model, params, hyper, off)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.loss_scaler = self._make_loss_scaler()

    def __new__(cls, model: nn.Module, cfg: Any, **kwargs: Any) -> ZeroEngine:
        # Stage 3 partitions the parameters themselves: its engine lives in zero/stage3_engine.py.
        if cls is ZeroEngine and int(cfg.zero_optimization.stage) == 3:
            from zero.stage3_engine import Stage3Engine

            cls = Stage3Engine
        return super().__new__(cls)

    def _setup_stage3(
        self, model: nn.Module, params: List[nn.Parameter], hyper: Dict[str, Any], off: Any
    ) -> None:
        raise NotImplementedError("stage 3 is set up by zero.stage3_engine.Stage3Engine")

    def _setup_flat(
        self, model: nn.Module, params: List[nn.Parameter], hyper: Dict[str, Any], off: Any
    ) -> None:
        """Stages 0-2: flat parameter and gradient buffers; the rank's partition is a slice."""
        rank, world_size, rule, zcfg = self.rank, self.world_size, self.rule, self.config.zero_optimization
        # -- flat buffers: remember fp32 weights before a cast to 16 bits loses their low bits. fp32
        # weights stay exact in the flat buffer: the master is filled from there, no full-size copy.
        fp32_weights: Optional[torch.Tensor] = None
        if self.dtype != torch.float32:
            fp32_weights = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])
        model.to(self.device)
        if self.dtype != torch.float32:
            model.to(self.dtype)
        self.module = model
        configured = self.config.zero_offload.pinned_budget_bytes
        cap = default_pinned_budget(configured)
        self.pool = PinnedPool(cap)
        host_is_device = self.device.type == "cpu"
        aliased = host_is_device and self.dtype == torch.float32 and self.offload_device in ("none", "cpu")
        alloc = self.pool.allocate if (aliased and self.offload_device == "cpu") else None
        self.flat = FlatParams(params, world_size, alloc=self._budgeted(alloc, "the flat parameter buffers"))
        if self.stage == 0 or world_size == 1:
            self.lo, self.hi = 0, self.flat.padded_numel
        else:
            self.lo, self.hi = partition_range(self.flat.padded_numel, rank, world_size)
        self.part_numel = self.hi - self.lo
        self.optimizer = ZeroOptimizer(params, rule, hyper)
        self.optimizer.engine = self

        # -- the rank's fp32 gradient partition, master and states
        grads_aliased = host_is_device and self.dtype == torch.float32
        if grads_aliased:
            self.grad_host = self.flat.grad_buffer[self.lo : self.hi]
        elif self.offload_device == "none":
            self.grad_host = torch.zeros(self.part_numel, dtype=torch.float32, device=self.device)
        else:
            # fresh pinned memory reads as zeros: a zero_() pass would only fault every page in now
            self.grad_host = self._pinned(self.part_numel, "the fp32 gradient partition")
        self._grads_aliased = grads_aliased
        sub_group = max(1, int(zcfg.sub_group_size))
        init: Union[torch.Tensor, Callable[[int, int, torch.Tensor], None]]
        if fp32_weights is None:
            buf, lo = self.flat.param_buffer, self.lo  # the padding is zero there too

            def init(start: int, n: int, out: torch.Tensor) -> None:
                out.copy_(buf[lo + start : lo + start + n])

        else:
            init = torch.zeros(self.part_numel, dtype=torch.float32)
            real = max(0, min(self.hi, self.flat.numel) - self.lo)
            init[:real] = fp32_weights[self.lo : self.lo + real]
            del fp32_weights
        self._init_state(init, aliased, sub_group, off)

        # -- communication, hooks, scheduler, loss scaling
        self.reducer: Optional[GradReducer] = None
        if world_size > 1:
            self.reducer = GradReducer(
                self.flat,
                stage=self.stage,
                rank=rank,
                world_size=world_size,
                bucket_numel=int(zcfg.reduce_bucket_size),
                overlap=bool(zcfg.overlap_comm),
            )
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)]
        self._setup_overlap(off)

    def _setup_overlap(self, off: Any) -> None:
        """Stepping sub-groups during backward (offload_optimizer.pipeline_read / pipeline_write).

        Each sub-group is stepped as soon as its gradients are final, so its NVMe read, update and write
        overlap the rest of backward. The update must not depend on gradients still to come, which rules
        out gradient clipping (needs the global norm first) and several ranks (the reduction ends with
        backward); there the optimizer runs after backward as usual. A pass that fails or finds an fp16
        overflow is not committed (two NVMe copies), exactly as after backward.
        """
        self._early_gate: Optional[GradReadiness] = None
        self._early_thread: Optional[threading.Thread] = None
        self._early_result: Optional[Tuple[bool, Optional[BaseException], int, bool]] = None
        self._grad_fetch: Optional[DeviceGradFetch] = None
        state = self._state
        if not (
            off is not None
            and bool(getattr(off, "pipeline", False))
            and isinstance(state, OptimizerSwapper)
            and state.copies > 1
            and self.world_size == 1
            and self.gradient_clipping <= 0
        ):
            return
        state.step_order = list(reversed(range(len(state.chunks))))  # backward makes the last grads first
        self._early_gate = self._make_grad_gate(state.chunks)

    def _make_grad_gate(self, chunks: List[Tuple[int, int]]) -> GradReadiness:
        """Readiness of the optimizer's chunks; sources are the flat buffer's parameters (`_grad_hook`).

        On a GPU each chunk's gradients are copied to the pinned host partition as the chunk completes."""
        if self.device.type == "cuda":
            src = self.flat.grad_buffer[self.lo : self.hi]
            self._grad_fetch = DeviceGradFetch(src, self.grad_host, chunks, self.device)
            on_ready = self._grad_fetch.chunk_ready
            return GradReadiness.for_flat(self.flat, self.lo, chunks, on_ready)
        return GradReadiness.for_flat(self.flat, self.lo, chunks)

    def _early_grads(self) -> torch.Tensor:
        """The partition's gradients as the pass during backward reads them (filled while it runs)."""
        if self._grad_fetch is not None:
            return self.grad_host  # each chunk copied from the GPU by the ready gate (`_early_ready`)
        # The kernel reads 16-bit gradients itself: the gradient buffer is used in place, never copied.
        return self.flat.grad_buffer[self.lo : self.hi]

    def _early_ready(self, gate: GradReadiness) -> Callable[[int], bool]:
        """The optimizer thread's wait for chunk c: its gradients final, and on the host."""
        fetch = self._grad_fetch
        if fetch is None:
            return gate.wait

        def ready(c: int) -> bool:
            if not gate.wait(c):
                return False
            fetch.fetch(c)
            return True

        return ready

    # --------------------------------------------------------------------------------------------- set-up
    @staticmethod
    def _trainable_params(model: nn.Module, model_parameters: Optional[Any]) -> List[nn.Parameter]:
        if model_parameters is None:
            candidates: List[Any] = list(model.parameters())
        else:
            candidates = []
            for item in model_parameters:
                if isinstance(item, dict):  # a param group
                    candidates.extend(item["params"])
                else:
                    candidates.append(item)
        seen, params = set(), []
        for p in candidates:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for p in params):
            raise ValueError("model_parameters contains tensors that are not parameters of the model")
        return params

    def _budgeted(self, alloc: Optional[Callable], what: str) -> Optional[Callable]:
        if alloc is None:
            return None

        def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return self._pinned(numel, what, dtype)

        return allocate

    def _pinned(self, numel: int, what: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        try:
            return self.pool.allocate(numel, dtype)
        except PinnedMemoryBudgetError as e:
            err = PinnedMemoryBudgetError(e.requested, e.in_use, e.cap)
            err.args = (
                f"{e} - needed for {what} ({numel} x {dtype}); raise zero_offload.pinned_budget_bytes "
                f"or {PINNED_BUDGET_ENV}",
            )
            raise err from None

    def _init_state(
        self,
        init: Union[torch.Tensor, Callable[[int, int, torch.Tensor], None]],
        aliased: bool,
        sub_group: int,
        off: Any,
        swap_copies: int = 2,
    ) -> None:
        """fp32 master (from `init`: the values, or `fill(start, n, out)` so NVMe never needs them whole)
        and optimizer states on the offload tier. `swap_copies=1`: NVMe state updated in place (stage 3
        when the disk cannot hold two copies; steps are then not atomic)."""
        n_states = self.rule.n_states
        part = self.part_numel
        if callable(init) and self.offload_device != "nvme" and not aliased:
            values = torch.empty(part, dtype=torch.float32)
            init(0, part, values)
            init = values
        if self.offload_device == "nvme":
            nvme_path = check_nvme_path(off.nvme_path or "")
            buffer_count = max(1, int(off.buffer_count))
            alignment = 4096
            chunk = self._slot_numel(sub_group, buffer_count, n_states, alignment)
            self._space = SwapSpace(nvme_path, alignment=alignment, prefix=f"zero-offload-r{self.rank}-")
            try:
                self._state = OptimizerSwapper(
                    self._space,
                    part,
                    n_states,
                    self.pool,
                    chunk_numel=chunk,
                    buffer_count=buffer_count,
                    aio=self.config.aio,
                    name=f"optim-rank{self.rank}",
                    **({"copies": swap_copies} if swap_copies != 2 else {}),
                )
            except BaseException:
                self._space.close()  # no half-built swap directory left behind
                raise

            def fill(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
                if callable(init):
                    init(start, n, master)
                else:
                    master.copy_(init[start : start + n])

            try:
                self._state.load(fill, states_zero=True)
            except BaseException:
                self._state.close()
                self._space.close()
                raise
            self._state.stats.reset()  # the initial write is not part of any step's report
            chunk_for_writer = self._state.chunk_numel
        else:
            pinned = self.offload_device == "cpu"
            if aliased:
                master = self.flat.param_buffer[self.lo : self.hi]
                if not callable(init):
                    master.copy_(init)  # the fp32 weights, bit for bit (already there: same values)
            elif pinned:
                master = self._pinned(part, "the fp32 master partition").copy_(init)
            else:
                master = init.to(self.device)
            if pinned:
                states = [self._pinned(part, "the optimizer states") for _ in range(n_states)]  # zeros
            else:
                states = [torch.zeros(part, dtype=torch.float32, device=self.device) for _ in range(n_states)]
            chunk_for_writer = min(sub_group, part)
            self._state = DeviceState(master, states, chunk_for_writer, pinned=pinned)
            if self.device.type == "cuda" and not pinned:
                self._torch_opt = self._device_optimizer(master, states)
        self._writer = self._make_writer(aliased, chunk_for_writer)

    def _make_writer(self, aliased: bool, chunk_numel: int) -> Any:
        return _ParamWriter(
            self.flat, self.lo, aliased, chunk_numel, self.pool if self.device.type == "cuda" else None
        )

    def _slot_numel(self, sub_group: int, buffer_count: int, n_states: int, alignment: int) -> int:
        """Elements per staging slot (the swapper's chunk): DeepSpeed's staging memory for the same config
        if the budget allows, else less (a smaller piece of a sub-group).

        DeepSpeed's `buffer_count` counts fp32 buffers of one sub-group each (`sub_group_size` elements), and
        a sub-group in flight takes 1 + n_states of them. Our slots each hold master and states of one chunk
        so that `buffer_count` chunks can be in flight at once (read ahead, update, write behind): chunks of
        sub_group / (1 + n_states) elements keep the pinned total at DeepSpeed's buffer_count x sub_group x 4
        bytes while every slot still pipelines."""
        free = self.pool.cap_bytes - self.pool.bytes_in_use
        if self.device.type == "cuda":
            free -= 2 * min(sub_group, self.part_numel) * torch.empty((), dtype=self.dtype).element_size()
        want = swap_chunk(sub_group, self.part_numel, n_states * 4)  # the estimator's formula
        if buffer_count * slot_bytes(want, n_states, alignment) <= free:
            return want
        per_slot = free // buffer_count
        numel = (per_slot // ((1 + n_states) * 4)) // 1024 * 1024
        floor = min(MIN_SLOT_NUMEL, want)
        if numel < floor:
            need = buffer_count * slot_bytes(floor, n_states, alignment) + self.pool.bytes_in_use
            raise ValueError(
                f"pinned memory budget too small for NVMe staging: {self.pool.cap_bytes} bytes "
                f"(zero_offload.pinned_budget_bytes / {PINNED_BUDGET_ENV}) with "
                f"{self.pool.bytes_in_use} bytes already used for gradients; "
                f"offload_optimizer.buffer_count={buffer_count} slots of {want} elements "
                f"(sub_group_size={sub_group}, {1 + n_states} fp32 tensors each) need "
                f"{buffer_count * slot_bytes(want, n_states, alignment)} bytes, and at least {need} bytes in "
                "total are needed to split sub-groups into smaller pieces"
            )
        return numel

    def _device_optimizer(self, master: torch.Tensor, states: List[torch.Tensor]) -> torch.optim.Optimizer:
        """offload none on CUDA: torch's fused Adam/AdamW on the flat fp32 partition."""
        if self.rule.kind not in ("adam", "adamw"):
            raise NotImplementedError(
                f"optimizer {self.rule.kind!r} without offload on CUDA is not supported; "
                "use offload_optimizer.device cpu or nvme"
            )
        g = self.optimizer.param_groups[0]
        param = nn.Parameter(master, requires_grad=False)
        cls = torch.optim.AdamW if g["adamw_mode"] else torch.optim.Adam
        opt = cls(
            [param], lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"], fused=True
        )
        opt.state[param] = {
            "step": torch.zeros((), dtype=torch.float32, device=self.device),
            "exp_avg": states[0],
            "exp_avg_sq": states[1],
        }
        self._device_param = param
        return opt

    def _make_scheduler(self, lr_scheduler: Optional[Any]) -> Optional[Any]:
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.optimizer)
            return lr_scheduler
        if self.config.scheduler is not None:
            from zero.schedulers import build_scheduler

            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    def _make_loss_scaler(self) -> Optional[Any]:
        if not self.fp16:
            return None
        from zero.loss_scaler import DynamicLossScaler, StaticLossScaler

        f = self.config.fp16
        if f.loss_scale and f.loss_scale > 0:
            return StaticLossScaler(float(f.loss_scale))
        return DynamicLossScaler.from_config(f)

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self.flat.claim_grad(index)
            if self.reducer is not None:
                self.reducer.grad_ready(index)
            if self._early_thread is not None:
                self._early_gate.param_ready(index)  # type: ignore[union-attr]

        return hook

    # ------------------------------------------------------------------------------------ DeepSpeed face
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A forward between backward and step() sees the committed weights: the pass that began stepping
        # during backward is dropped (step() then runs the optimizer after all).
        self._discard_early_pass()
        with self._clock.phase("forward_s"):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def train_batch_size(self) -> int:
        return self.train_batch_size_

    def get_lr(self) -> List[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        self._discard_early_pass()  # it read gradients that are being cleared
        self.flat.zero_grads()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss / gradient_accumulation_steps` (times the loss scale in fp16)."""
        self._check_open()
        self.check_state_usable()
        boundary = self.is_gradient_accumulation_boundary()
        if self.reducer is not None and boundary:
            self.reducer.begin()
        if boundary:
            # NVMe: the first sub-groups' states do not depend on the gradients; read them during backward.
            self._discard_early_pass()  # a second boundary backward without step(): start over
            self._state.prefetch()
        early = boundary and getattr(self, "_early_gate", None) is not None and not retain_graph
        if early:
            self._start_early_pass()
        scale = self.loss_scale / self.gas
        try:
            with self._clock.phase("backward_s"):
                scaled = loss.float() * scale if scale != 1.0 else loss
                scaled.backward(retain_graph=retain_graph)
        except BaseException:
            if early:
                self._discard_early_pass()
            raise
        if early:
            if self._grad_fetch is not None:
                self._grad_fetch.backward_done()  # before the gate opens chunks no hook completed
            self._early_gate.all_ready()  # type: ignore[union-attr]
        if self.reducer is not None and boundary:
            with self._clock.phase("comm_s"):
                self.reducer.finish()
        self._clock.current.micro_batches += 1
        return loss

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Count the micro-batch; at the end of an accumulation window, update the weights."""
        self._check_open()
        self.check_state_usable()
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
            self.global_steps += 1
            self.global_samples += self.train_batch_size_
            report = self._finish_report()
            if self.report_enabled and self.rank == 0 and self.global_steps % self.report_every == 0:
                print(f"[zero] {report.format()}", flush=True)
        self.micro_steps += 1

    # -------------------------------------------------------------------------------------- the update
    def _take_model_step(self, lr_kwargs: Optional[Dict[str, Any]]) -> None:
        rep = self._clock.current
        if self.reducer is not None:
            rep.comm_bytes += self.reducer.bytes_sent
            self.reducer.bytes_sent = 0
        with self._clock.phase("optimizer_s"):
            overflow = self._optimizer_pass(rep)
        if not overflow and self.world_size > 1 and self.stage >= 1:
            with self._clock.phase("comm_s"):
                self._allgather_params()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.optimizer._opt_called = True  # torch's schedulers check that the optimizer stepped first
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.zero_grad()
        rep.skipped = overflow
        rep.loss_scale = self.loss_scale

    def _grad_scale_and_overflow(self, fused_check: bool) -> Tuple[float, bool]:
        """The divisor for raw gradient sums, and whether an overflow was already found."""
        grad_scale = self.loss_scale * self.world_size  # sum over ranks -> mean, and unscale
        if not (self.gradient_clipping > 0 or (self.fp16 and not fused_check)):
            return grad_scale, False
        sq = torch.linalg.vector_norm(self.grad_host, dtype=torch.float32).pow(2).reshape(1)
        if self.world_size > 1 and self.stage >= 1:
            sq = sq.to(self.device) if self.device.type == "cuda" else sq
            settle(dist.all_reduce(sq, async_op=True))
        norm = math.sqrt(float(sq.item())) / grad_scale if math.isfinite(float(sq.item())) else math.inf
        if not math.isfinite(norm):
            return grad_scale, bool(self.fp16)
        self.last_grad_norm = norm
        if self.gradient_clipping > 0:
            coef = self.gradient_clipping / (norm + 1e-6)
            if coef < 1.0:
                grad_scale /= coef
        return grad_scale, False

    # --------------------------------------------------------------- optimizer steps during backward
    def _chunk_update(
        self, grad: torch.Tensor, step: int, group: Dict[str, Any], grad_scale: float, fused_check: bool
    ) -> Callable[[int, int, torch.Tensor, List[torch.Tensor]], bool]:
        """The swapper's per-chunk update: the optimizer rule on [start, start + n), then the copy-back."""
        rule, writer = self.rule, self._writer

        def update(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> bool:
            ok = rule.apply(
                master,
                grad[start : start + n],
                states,
                step=step,
                group=group,
                grad_scale=grad_scale,
                param_copy=writer.param_copy(start, n),
                check_finite=fused_check,
            )
            if ok:
                self._pass_updates += 1
                writer.after_update(start, n, master)
            return ok

        return update

    def _start_early_pass(self) -> None:
        """Start the NVMe pass on a worker thread; it steps each sub-group once its gradients are final."""
        gate = self._early_gate
        assert gate is not None
        fused_check = self.fp16  # no clipping here; an overflow stops the pass and nothing is committed
        grad_scale = self.loss_scale * self.world_size
        step = self.optimizer.step_count + 1
        group = self.optimizer.param_groups[0]
        grad = self._early_grads()
        h2d0 = self._writer.h2d_bytes
        update = self._chunk_update(grad, step, group, grad_scale, fused_check)

        ready = self._early_ready(gate)

        def run() -> None:
            try:
                ok = self._state.step(update, ready=ready)
                self._early_result = (ok, None, h2d0, fused_check)
            except BaseException as e:  # noqa: BLE001 - handed to step() on the main thread
                self._early_result = (False, e, h2d0, fused_check)

        if self._grad_fetch is not None:
            self._grad_fetch.begin()
        gate.begin()
        self._early_result = None
        self._pass_updates = 0
        self._early_thread = threading.Thread(target=run, name="zero-optimizer-overlap", daemon=True)
        self._early_thread.start()

    def _join_early_pass(self) -> Optional[Tuple[bool, Optional[BaseException], int, bool]]:
        thread = self._early_thread
        if thread is None:
            return None
        thread.join()
        self._early_thread = None
        result, self._early_result = self._early_result, None
        return result

    def _discard_early_pass(self) -> None:
        """Stop a pass started during backward and undo its effect on the parameters (state uncommitted)."""
        if getattr(self, "_early_thread", None) is None:
            return
        self._early_gate.cancel()  # type: ignore[union-attr]
        result = self._join_early_pass()
        self._state.abort()
        self._restore_params()
        self._state.stats.reset()
        err = result[1] if result is not None else None
        if getattr(err, "steps_lost", 0):
            # The pass found the last step's write-back lost: the next step (or save) undoes that step,
            # exactly as without the overlapped pass.
            self._state.keep_lost(err)

    def _optimizer_pass(self, rep: StepReport) -> bool:
        """Run the optimizer over this rank's partition; True when the step was skipped (overflow)."""
        if getattr(self, "_early_thread", None) is not None:
            return self._finish_early_pass(rep)
        if not self._grads_aliased:
            self._gradients_to_host()
            rep.device_to_host_bytes += self.part_numel * self.flat.grad_buffer.element_size()
        nvme = isinstance(self._state, OptimizerSwapper)
        # The fused check needs an atomic step (two NVMe copies) to discard a half-done pass.
        fused_check = self.fp16 and nvme and self.gradient_clipping <= 0 and self._state.copies > 1
        grad_scale, overflow = self._grad_scale_and_overflow(fused_check)
        if overflow:
            return True
        step = self.optimizer.step_count + 1
        group = self.optimizer.param_groups[0]
        if self._torch_opt is not None:
            self._device_step(step, group, grad_scale)
            self.optimizer.step_count = step
            return False
        h2d0 = self._writer.h2d_bytes
        update = self._chunk_update(self.grad_host, step, group, grad_scale, fused_check)

        self._pass_updates = 0
        try:
            ok = self._state.step(update)
        except BaseException as e:
            self._raise_pass_failure(e, step)
        if fused_check and self.world_size > 1:
            flag = torch.tensor(
                [1.0 if ok else 0.0], device=self.device if self.device.type == "cuda" else "cpu"
            )
            settle(dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True))
            ok = bool(flag.item() > 0)
        return self._end_pass(ok, step, rep, h2d0)

    def _gradients_to_host(self) -> None:
        """The partition's gradients into grad_host, after backward.

        From 16-bit GPU gradients to the fp32 host partition in pieces (`D2H_PIECE_NUMEL`): a non-blocking
        copy that changes dtype converts on the GPU first, into a temporary as large as what it copies
        (4 GB of GPU memory for a 1B-parameter partition in one piece)."""
        src = self.flat.grad_buffer[self.lo : self.hi]
        copy_to_host(self.grad_host, src, 0, src.numel())
        if src.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _finish_early_pass(self, rep: StepReport) -> bool:
        """Wait for the pass started in backward, then commit it or keep the previous state."""
        result = self._join_early_pass()
        assert result is not None
        ok, err, h2d0, fused_check = result
        step = self.optimizer.step_count + 1
        if self._grad_fetch is not None:
            rep.device_to_host_bytes += self._grad_fetch.take_bytes()
        if err is not None:
            self._raise_pass_failure(err, step)
        return self._end_pass(ok, step, rep, h2d0)

    def _raise_pass_failure(self, err: BaseException, step: int) -> NoReturn:
        """An optimizer pass failed part way. Two NVMe copies: the committed state is intact, so the
        parameters are put back from it and the error raised (a retry redoes the update). In-place state
        (memory tiers, one NVMe copy) that the pass already changed is torn: the engine is poisoned."""
        self._state.abort()
        if self._pass_updates and not self._atomic_steps():
            self._writer.finish()
            self.poison_state(
                err,
                what=f"optimizer step {step} failed after it had updated part of the optimizer state "
                "in place (it cannot be rolled back)",
            )
            self.check_state_usable()
        self._restore_params()
        if getattr(err, "steps_lost", 0):  # the last step's deferred write-back failed: undo it too
            self.optimizer.step_count -= err.steps_lost  # type: ignore[attr-defined]
            self.zero_grad()  # computed on the lost step's weights
            raise err
        if isinstance(err, OSError):
            raise OSError(
                err.errno,
                f"optimizer step {step} failed while swapping optimizer state ({err.strerror}); "
                "the previous state is kept and training can continue from it",
                getattr(err, "filename", None),
            ) from err
        raise err

    def _end_pass(self, ok: bool, step: int, rep: StepReport, h2d0: int) -> bool:
        """Commit a finished pass (or drop it on overflow) and add its counts to the report; True: skipped."""
        if ok:
            self._state.commit()
            self.optimizer.step_count = step
        else:
            self._state.abort()
            self._restore_params()
        self._writer.finish()
        stats = self._state.stats  # counts since the last step, including reads prefetched during backward
        rep.optimizer_compute_s += stats.compute_s
        rep.io_wait_s += stats.io_wait_s
        rep.gradient_wait_s += stats.gate_wait_s  # 0 unless the pass ran during backward
        rep.nvme_read_bytes += stats.bytes_read
        rep.nvme_write_bytes += stats.bytes_written
        stats.reset()
        rep.host_to_device_bytes += self._writer.h2d_bytes - h2d0
        return not ok

    def _device_step(self, step: int, group: Dict[str, Any], grad_scale: float) -> None:
        opt = self._torch_opt
        assert opt is not None
        g = opt.param_groups[0]
        for k in ("lr", "betas", "eps", "weight_decay"):
            g[k] = group[k]
        self.grad_host.div_(grad_scale)
        self._device_param.grad = self.grad_host
        opt.state[self._device_param]["step"].fill_(step - 1)
        opt.step()
        self._device_param.grad = None
        self.flat.param_buffer[self.lo : self.hi].copy_(self._state.master)

    def _restore_params(self) -> None:
        """After an aborted pass: put the committed master back into the parameters. If that fails the
        parameters are partly the aborted pass's: the engine is poisoned (StateCorruptedError, chained)."""
        try:
            self._put_master_in_params()
        except Exception as e:
            self.poison_state(e, what="putting the committed fp32 master back into the parameters failed")
            self.check_state_usable()
        except BaseException as e:  # KeyboardInterrupt and the like: raised as they are, state marked
            self.poison_state(e, what="putting the committed fp32 master back into the parameters stopped")
            raise

    def _put_master_in_params(self) -> None:
        self._writer.finish()  # on a GPU: after the copies the aborted pass still had in flight
        target = self.flat.param_buffer

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            target[self.lo + start : self.lo + start + n].copy_(master)

        self._state.read_all(put)

    def _allgather_params(self) -> None:
        size = self.part_numel
        buf = self.flat.param_buffer
        outs = [buf[r * size : (r + 1) * size] for r in range(self.world_size)]
        settle(dist.all_gather(outs, buf[self.lo : self.hi].clone(), async_op=True))

    def _finish_report(self) -> StepReport:
        rep = self._clock.finish()
        rep.step = self.global_steps
        rep.pinned_bytes_in_use = pinned_bytes_in_use()
        rep.nvme_bytes_in_use = self._space.bytes_allocated if self._space is not None else 0
        self.last_report = rep
        return rep

    # ------------------------------------------------------------------------------ state and checkpoints
    @property
    def pinned_bytes(self) -> int:
        return self.pool.bytes_in_use

    @property
    def nvme_bytes(self) -> int:
        return self._space.bytes_allocated if self._space is not None else 0

    @property
    def swap_dir(self) -> Optional[str]:
        return self._space.dir if self._space is not None else None

    # ------------------------------------------------------------------------------------- state integrity
    @property
    def state_error(self) -> Optional[BaseException]:
        """The failure that made the training state unusable (see `check_state_usable`); None when usable."""
        return getattr(self, "_state_error", None)

    def check_state_usable(self) -> None:
        """Raise `StateCorruptedError` if a failure may have left master, optimizer states or parameters
        inconsistent (an I/O error while state was updated in place, a failed restore, a checkpoint load
        that stopped part way). Steps, backward and checkpoint saves call this; loading a checkpoint
        completely (with its optimizer states) makes the engine usable again."""
        err = self.state_error
        if err is None:
            return
        raise StateCorruptedError(
            f"the engine's training state is unusable: {self._state_error_what}: {_describe(err)}. The fp32 "
            "master, optimizer states and parameters may be partly updated, so steps and checkpoint saves "
            "are refused: load a checkpoint to continue (engine.load_checkpoint, with its optimizer states)",
            err,
        ) from err

    def poison_state(self, err: BaseException, what: Optional[str] = None) -> None:
        """Mark the training state unusable because of `err` (e.g. an I/O error that stopped a checkpoint
        load half way): `step`, `backward` and saves raise `StateCorruptedError` until
        `mark_state_restored()`. A `StateCorruptedError` passed here keeps naming its original error."""
        if isinstance(err, StateCorruptedError) and err.original is not None:
            if self.state_error is err.original:
                return
            err = err.original
        self._state_error = err
        self._state_error_what = what or "an operation that changes it failed part way"

    def mark_state_restored(self) -> None:
        """A checkpoint's module weights and optimizer states were loaded completely: usable again."""
        self._state_error = None
        self._state_error_what = ""

    def prepare_checkpoint_save(self) -> None:
        """Settle the engine before a checkpoint reads its state: an optimizer pass started during backward
        is discarded (the committed state is saved, as without overlap), the last step's deferred NVMe
        writes are waited for - if one failed, that step is undone (parameters and step count back at the
        state before it) and its `DeferredWriteError` raised, so no save pairs its weights with the older
        optimizer state - and an unusable state raises `StateCorruptedError`. Afterwards master, states
        and parameters read consistently until the next step."""
        self._check_open()
        self.check_state_usable()
        self._discard_early_pass()
        self._settle_write_back()
        self.check_state_usable()

    def sync_master_from_module(self) -> None:
        """Rebuild the fp32 master of every tier from the module's current weights (optimizer states are
        kept): after loading only the module's weights, the next step starts from them instead of the old
        master overwriting them. With 16-bit weights the master takes their (16-bit) values.

        NVMe with two copies writes the new master atomically; an error part way through leaves master
        and module different, so the engine is poisoned (as it is for one copy or memory tiers)."""
        self._check_open()
        self._discard_early_pass()
        err = self._state.take_lost()
        if err is not None:  # the states are back at the step before: count that, keep the loaded weights
            self.optimizer.step_count -= err.steps_lost
            warnings.warn(
                f"the last optimizer step was lost before the master was rebuilt from the module: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
        fill = self._master_from_module()

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            fill(start, n, master)

        try:
            self._state.rewrite(put)
        except BaseException as e:
            self.poison_state(e, what="rebuilding the fp32 master from the module's weights failed")
            if isinstance(e, Exception):
                self.check_state_usable()
            raise
        self._state.stats.reset()  # not part of the next step's report

    def _master_from_module(self) -> Callable[[int, int, torch.Tensor], None]:
        """fill(start, n, out): the module's weights of [start, start + n) of the partition, as fp32."""
        buf, lo = self.flat.param_buffer, self.lo  # the parameters are views of it; the padding is zero

        def fill(start: int, n: int, out: torch.Tensor) -> None:
            src = buf[lo + start : lo + start + n]
            if out.data_ptr() != src.data_ptr():  # aliased (fp32 on the host): the master is the weights
                out.copy_(src)

        return fill

    def _atomic_steps(self) -> bool:
        """Whether a failed optimizer pass leaves the committed state untouched (two NVMe copies)."""
        return isinstance(self._state, OptimizerSwapper) and self._state.copies > 1

    def _settle_write_back(self) -> None:
        """Wait for the writes the last step left in flight. If one failed, the swapper is back at the state
        before that step: undo the engine's side of it too (parameters, step count, gradients computed on
        its weights) and raise the `DeferredWriteError`."""
        err = self._state.take_lost()
        if err is None:
            return
        self._restore_params()
        self.optimizer.step_count -= err.steps_lost
        self.zero_grad()
        raise err

    def optimizer_state_dict(self) -> Dict[str, Any]:
        self._discard_early_pass()  # between backward and step: the committed state, as without overlap
        self._settle_write_back()
        master = torch.empty(self.part_numel, dtype=torch.float32)
        states = [torch.empty(self.part_numel, dtype=torch.float32) for _ in range(self.rule.n_states)]

        def take(start: int, n: int, m: torch.Tensor, st: List[torch.Tensor]) -> None:
            master[start : start + n].copy_(m)
            for dst, src in zip(states, st):
                dst[start : start + n].copy_(src)

        self._state.read_all(take)
        return {
            "rule": self.rule.kind,
            "param_groups": [self.optimizer.hyperparameters()],
            "step": self.optimizer.step_count,
            "partition": (self.lo, self.hi),
            "master": master,
            "states": states,
        }

    def load_optimizer_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd["rule"] != self.rule.kind or tuple(sd["partition"]) != (self.lo, self.hi):
            raise ValueError(
                f"optimizer state is for {sd['rule']} over partition {tuple(sd['partition'])}, "
                f"this engine runs {self.rule.kind} over {(self.lo, self.hi)}"
            )
        self._discard_early_pass()
        master, states = sd["master"], sd["states"]

        def put(start: int, n: int, m: torch.Tensor, st: List[torch.Tensor]) -> None:
            m.copy_(master[start : start + n])
            for dst, src in zip(st, states):
                dst.copy_(src[start : start + n])

        try:
            self._state.load(put)  # two NVMe copies: atomic; otherwise in place
        except BaseException as e:
            if not self._atomic_steps():
                self.poison_state(e, what="loading the optimizer state failed part way")
            raise
        self.optimizer.param_groups[0].update(sd["param_groups"][0])
        self.optimizer.step_count = int(sd["step"])
        self._restore_params()

    def save_checkpoint(
        self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict[str, Any]] = None
    ) -> str:
        from zero.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        allow_pickle: bool = False,
    ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """DeepSpeed's load_checkpoint; `allow_pickle=True` also loads what only pickle can restore (see
        zero.checkpoint.load_checkpoint: only for checkpoints from a trusted source)."""
        from zero.checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            allow_pickle=allow_pickle,
        )

    # --------------------------------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Free pinned buffers and remove the swap files. The model stays usable (weights are kept)."""
        if self._closed:
            return
        if getattr(self, "_early_thread", None) is not None:
            self._early_gate.cancel()  # type: ignore[union-attr]
            self._join_early_pass()  # nothing may touch the slots once they are freed
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._close_optimizer_state()
        # Give the model weights of its own, then drop every reference to the flat and pinned buffers so
        # their memory goes back to the system now rather than when the engine object is collected.
        with torch.no_grad():
            for p in self.flat.params:
                p.data = p.data.clone()
                p.grad = None
        self.flat.release()

    def _close_optimizer_state(self) -> None:
        """Free the optimizer side (copy-back writer, states, swap space) and drop the references to it."""
        try:
            if self._writer is not None:
                self._writer.close()
            if self._state is not None:
                self._state.close()  # may raise a write-back error nothing reported yet
        finally:
            # the swap directory goes even then: its files are scratch, never the only copy of a checkpoint
            if self._space is not None:
                self._space.close()
            self.grad_host = None  # type: ignore[assignment]
            self._state = None
            self._writer = None
            self._torch_opt = None

    def __enter__(self) -> ZeroEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"ZeroEngine(stage={self.stage}, offload={self.offload_device}, dtype={self.dtype}, "
            f"rank={self.rank}/{self.world_size}, params={self.flat.numel}, device={self.device})"
        )
