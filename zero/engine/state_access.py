"""Per-parameter access to a training engine's state: fp32 master, optimizer states and gradients.

The engine part behind DeepSpeed's `safe_get_full_*` / `safe_set_*` accessors (zero.utils). A parameter's
elements are spread over the rank's flat optimizer partition as one or more fragments
`(partition offset, element offset in the flattened parameter, count)`:

* stages 0-2 (`FlatLayout`): the parameter's slice of the flat buffer that falls into the rank's
  partition `[lo, hi)` (the whole parameter at stage 0 or with one rank);
* stage 3 (`UnitLayout`): the parameter's share in each trained unit's partition (its `ds_tensor`); the
  local forms are its whole chunk, DeepSpeed's `ds_tensor.ds_numel` elements, the padding zeros.

Master and states are read and written through the state's tier (`StateTier.read_all` / `rewrite`): device
or pinned memory in place, NVMe through the swap files (with two copies a write is atomic) - never a copy
that could be stale. Each call is one pass over the rank's state, like a checkpoint's. Gradients live in
memory on every tier (the partition the optimizer reads), between the boundary backward and `step()`.

"Full" values are the whole parameter, assembled over ranks with one all-reduce where the state is
partitioned (collective then: every rank calls it); "local" values are this rank's share, 1-D.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zero.optimizer.rules import _STATE_NAMES

__all__ = ["Fragment", "StateAccess", "access_of"]

Fragment = Tuple[int, int, int]  # (offset in the rank's partition, offset in the flattened parameter, count)

_ATTR = "_zero_state_access"  # on each trained parameter: a weak reference to its engine's StateAccess

# Names other libraries use for the same state (torch's Adagrad keeps "sum").
_ALIASES = {"sum": "state_sum"}


def access_of(param: Any) -> Optional[StateAccess]:
    """The StateAccess of the live engine that trains `param`; None when no engine does."""
    ref = getattr(param, _ATTR, None)
    acc = ref() if ref is not None else None
    if acc is None or acc.engine_closed():
        return None
    return acc


class StateAccess:
    """Fragments of every trained parameter of one engine, and reads and writes of their state."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)
        layout = engine.layout
        self.world_size, self.rank = engine.world_size, engine.rank
        self.device = engine.device
        self.frags: Dict[int, List[Fragment]] = {}
        # stage 3: (partition offset, elements) of each parameter's whole chunk, padding included: the local
        # forms are DeepSpeed's, `ds_tensor.ds_numel` elements on every rank, the padding reading as zeros
        self.chunks: Dict[int, Tuple[int, int]] = {}
        self.params: Dict[int, nn.Parameter] = {}
        if layout.partitioner is None:
            flat = layout.flat
            # stage 0 (or one rank): the partition is the whole flat buffer, on every rank
            self.partitioned = layout.gathers_after_step
            for p, a, n in zip(flat.params, flat.offsets, flat.numels):
                s, z = max(a, layout.lo), min(a + n, layout.hi)
                self._add(p, [(s - layout.lo, s - a, z - s)] if s < z else [])
        else:
            self.partitioned = self.world_size > 1
            for u in layout.units:
                base = layout.offsets[u.index]
                for i in layout._trained.get(u.index, u.trainable):
                    lo, hi = u.share(i)
                    at = base + u.part_offsets[i]
                    # no fragment on a rank past a small parameter's end (its chunk is all padding)
                    self._add(u.params[i], [(at, lo, hi - lo)] if lo < hi else [])
                    self.chunks[id(u.params[i])] = (at, u.chunks[i])
        me = weakref.ref(self)
        for p in self.params.values():
            setattr(p, _ATTR, me)

    def _add(self, p: nn.Parameter, frags: List[Fragment]) -> None:
        self.params[id(p)] = p
        self.frags.setdefault(id(p), []).extend(frags)

    # ------------------------------------------------------------------------------------ bookkeeping
    def engine_closed(self) -> bool:
        """Whether the engine was closed or collected."""
        e = self._engine()
        return e is None or e._closed

    def detach(self) -> None:
        """Forget the parameters (the engine is closing): the accessors then return None for them."""
        for p in self.params.values():
            if getattr(p, _ATTR, None) is not None and getattr(p, _ATTR)() is self:
                delattr(p, _ATTR)
        self.params.clear()

    def _engine_open(self) -> Any:
        e = self._engine()
        if e is None or e._closed:
            raise RuntimeError("the engine that trains this parameter is closed")
        return e

    @staticmethod
    def full_numel(p: nn.Parameter) -> int:
        """Elements of the whole parameter (`ds_numel` of a stage-3 parameter)."""
        return int(getattr(p, "ds_numel", p.numel()))

    @staticmethod
    def full_shape(p: nn.Parameter) -> torch.Size:
        """Shape of the whole parameter (`ds_shape` of a stage-3 parameter)."""
        return getattr(p, "ds_shape", p.shape)

    def local_numel(self, p: nn.Parameter) -> int:
        """Elements of the parameter's local forms: its elements in this rank's partition, at stage 3 its
        whole chunk (`ds_tensor.ds_numel`, padding included)."""
        chunk = self.chunks.get(id(p))
        return chunk[1] if chunk is not None else sum(n for _, _, n in self.frags[id(p)])

    def state_index(self, key: Optional[str]) -> int:
        """0 for the master (key None), 1 + the state's position for an optimizer state's name."""
        if key is None:
            return 0
        e = self._engine_open()
        names = _STATE_NAMES[e.rule.kind]
        name = _ALIASES.get(key, key)
        if name not in names:
            raise KeyError(
                f"optimizer state {key!r}: the {e.rule.kind} optimizer keeps {', '.join(map(repr, names))}"
            )
        if e.rule.state_dtype == "int8":
            raise NotImplementedError(
                f"optimizer state {key!r} is kept as 8-bit codes (optimizer state_dtype 'int8'); "
                "read it through a checkpoint (zero.checkpoint.to_fp32) or keep states in fp32/bf16"
            )
        return 1 + names.index(name)

    def _settle(self, e: Any) -> None:
        """Before touching the optimizer state: the committed state, no pass in flight."""
        e.check_open()
        e._update.drop_overlapped()
        e.settle_update()
        e._opt.settle_write_back()

    # ------------------------------------------------------------------------------ master and states
    def read_local(self, params: Sequence[nn.Parameter], index: int) -> List[torch.Tensor]:
        """This rank's share of master (index 0) or state `index` of each parameter, fp32, 1-D, in
        flattened-parameter order (one pass over the tier for all of them)."""
        e = self._engine_open()
        self._settle(e)
        outs = [torch.zeros(self.local_numel(p), dtype=torch.float32) for p in params]
        spans = [self._read_spans(p) for p in params]

        def take(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            src = master if index == 0 else states[index - 1]
            for out, sp in zip(outs, spans):
                for poff, loff, cnt in sp:
                    a, z = max(poff, start), min(poff + cnt, start + n)
                    if a < z:
                        out[loff + a - poff : loff + z - poff].copy_(src[a - start : z - start])

        e._opt.tier.read_all(take)
        e._opt.tier.stats.reset()  # not part of the next step's report
        return outs

    def write_local(self, values: Sequence[Tuple[nn.Parameter, torch.Tensor]], index: int) -> None:
        """Set this rank's share of master (index 0) or state `index` of each parameter from 1-D fp32
        values; the master's new values reach the model-dtype weights too."""
        e = self._engine_open()
        self._settle(e)
        items = [(self._local_spans(p), v.detach().reshape(-1).to("cpu", torch.float32)) for p, v in values]

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            dst = master if index == 0 else states[index - 1]
            for sp, val in items:
                for poff, loff, cnt in sp:
                    a, z = max(poff, start), min(poff + cnt, start + n)
                    if a < z:
                        dst[a - start : z - start].copy_(val[loff + a - poff : loff + z - poff])

        try:
            e._opt.tier.rewrite(put)
        except BaseException as err:
            if not e._opt.atomic:
                e.poison_state(err, "setting optimizer state through zero.utils failed part way")
            raise
        e._opt.tier.stats.reset()
        if index == 0:
            e._opt.restore_params()  # the weights follow the master, as after a step

    def _read_spans(self, p: nn.Parameter) -> List[Tuple[int, int, int]]:
        """`_local_spans`, at stage 3 the whole chunk (its padding reads as the zeros the partition holds
        there; writes take only the real elements, so the padding stays zero)."""
        chunk = self.chunks.get(id(p))
        if chunk is None:
            return self._local_spans(p)
        return [(chunk[0], 0, chunk[1])] if chunk[1] else []

    def _local_spans(self, p: nn.Parameter) -> List[Tuple[int, int, int]]:
        """(partition offset, offset in the local value, count) of each fragment."""
        spans, k = [], 0
        for poff, _, cnt in self.frags[id(p)]:
            spans.append((poff, k, cnt))
            k += cnt
        return spans

    # ---------------------------------------------------------------------------------------- gradients
    def _grad_partition(self, e: Any) -> torch.Tensor:
        g = e.layout.early_grads(False)
        if g is None:
            raise RuntimeError("the engine holds no gradients")
        return g

    def grad_scale(self, e: Any) -> float:
        """Stored gradients are summed over ranks; DeepSpeed's are averaged (the loss scale stays in)."""
        return float(self.world_size) if self.world_size > 1 else 1.0

    def read_local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's share of the parameter's accumulated gradient (fp32; zeros before a backward)."""
        e = self._engine_open()
        g = self._grad_partition(e)
        out = torch.zeros(self.local_numel(p), dtype=torch.float32, device=g.device)
        if e._window_backwards == 0:
            return out  # no backward since the last step: nothing accumulated (buffers may hold the last)
        for poff, loff, cnt in self._read_spans(p):
            out[loff : loff + cnt].copy_(g[poff : poff + cnt])
        return out.div_(self.grad_scale(e)) if self.world_size > 1 else out

    def write_local_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Replace this rank's share of the parameter's gradient (between backward and step only)."""
        e = self._engine_open()
        if e._window_backwards == 0:
            raise RuntimeError(
                "gradients can be set between backward() and step() only (none accumulated since the last"
                " step)"
            )
        e._update.drop_overlapped()  # a pass started during backward read the old gradients
        g = self._grad_partition(e)
        val = value.detach().reshape(-1).to(g.device, torch.float32) * self.grad_scale(e)
        for poff, loff, cnt in self._local_spans(p):
            g[poff : poff + cnt].copy_(val[loff : loff + cnt])

    # ------------------------------------------------------------------------------------ full values
    def to_full(self, p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter from each rank's share (all-reduce of a zero-filled buffer: collective
        where the state is partitioned)."""
        full = torch.zeros(self.full_numel(p), dtype=torch.float32, device=local.device)
        k = 0
        for _, lo, cnt in self.frags[id(p)]:
            full[lo : lo + cnt].copy_(local[k : k + cnt])
            k += cnt
        if self.partitioned:
            comm = full if full.device.type != "cpu" or _gloo() else full.to(self.device)
            dist.all_reduce(comm)
            full = comm.to(full.device)
        return full.view(self.full_shape(p))

    def local_of(self, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a whole value of `p`."""
        if full.numel() != self.full_numel(p):
            raise ValueError(
                f"value has {full.numel()} elements, the parameter has {self.full_numel(p)} "
                f"(shape {tuple(self.full_shape(p))})"
            )
        flat = full.detach().reshape(-1)
        parts = [flat[lo : lo + cnt] for _, lo, cnt in self.frags[id(p)]]
        real = sum(cnt for _, _, cnt in self.frags[id(p)])
        if self.local_numel(p) > real:  # a stage-3 chunk's padding
            parts.append(flat.new_zeros(self.local_numel(p) - real))
        return torch.cat(parts) if parts else flat[:0]

    def check_local(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """`value` as this rank's share of `p`: ValueError when its element count differs."""
        if value.numel() != self.local_numel(p):
            raise ValueError(
                f"value has {value.numel()} elements, this rank's share of the parameter has "
                f"{self.local_numel(p)}"
            )
        return value

    def update_grads(self, params: Sequence[nn.Parameter], fn: Callable[[torch.Tensor, Any], Any]) -> None:
        """Replace each parameter's gradient with `fn(full gradient, parameter)`."""
        for p in params:
            new = fn(self.to_full(p, self.read_local_grad(p)), p)
            self.write_local_grad(p, self.local_of(p, torch.as_tensor(new)))


def _gloo() -> bool:
    return dist.is_initialized() and dist.get_backend() == "gloo"
