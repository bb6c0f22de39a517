"""Ranks agree on the outcome of each phase of a save or load before any of them goes on.

A rank that raised while the others wait in a collective would leave them blocked for the process group's
timeout. So every phase runs to its end on every rank, its outcome (a small code) is all-reduced, and only
then does each rank go on or raise: the failed rank its own error, the others a CheckpointError naming it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from zero.checkpoint._engine import CheckpointEngine
from zero.comm import settle
from zero.errors import CheckpointError

T = TypeVar("T")
OK, FAILED, NOTHING = 0, 1, 2


def attempt(fn: Callable[[], T]) -> Tuple[Optional[T], Optional[BaseException]]:
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - handed to agree(), which raises it after the vote
        return None, e


def _comm_device(engine: CheckpointEngine) -> torch.device:
    return engine.device if engine.device.type == "cuda" else torch.device("cpu")


def codes(engine: CheckpointEngine, code: int) -> List[int]:
    """Every rank's code, in rank order (a collective)."""
    if engine.world_size == 1:
        return [code]
    t = torch.zeros(engine.world_size, dtype=torch.int64, device=_comm_device(engine))
    t[engine.rank] = code
    settle(dist.all_reduce(t, async_op=True))
    return [int(c) for c in t.tolist()]


def agree(engine: CheckpointEngine, err: Optional[BaseException], what: str) -> None:
    """Raise on every rank if `what` failed on any: `err` here, a CheckpointError on the others."""
    votes = codes(engine, OK if err is None else FAILED)
    if err is not None:
        raise err
    failed = failed_ranks(votes)
    if failed:
        raise CheckpointError(
            f"{what} failed on {failed} (its error says why); rank {engine.rank} stopped too"
        )


def failed_ranks(votes: List[int]) -> str:
    """'rank 1', 'ranks 0, 2', or '' when none failed."""
    failed = [str(r) for r, c in enumerate(votes) if c == FAILED]
    return f"rank{'s' if len(failed) > 1 else ''} {', '.join(failed)}" if failed else ""


def all_gather_json(engine: CheckpointEngine, obj: Any) -> List[Any]:
    """Every rank's JSON-able `obj`, in rank order (a collective; no pickle)."""
    data = json.dumps(obj).encode()
    if engine.world_size == 1:
        return [json.loads(data)]
    dev = _comm_device(engine)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(engine.world_size)]
    settle(dist.all_gather(sizes, n, async_op=True))
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    outs = [torch.empty_like(buf) for _ in range(engine.world_size)]
    settle(dist.all_gather(outs, buf, async_op=True))
    return [json.loads(bytes(o[:k].cpu().numpy())) for o, k in zip(outs, lengths)]
