"""Collectives whose finished Work objects are released by Python, never by gloo's worker threads.

torch's gloo backend drops its own reference to a finished Work on a worker thread. If Python dropped its
reference first, that thread runs the destructor, which releases the tensors' Python objects and so takes
the GIL. When the collective was the process's last one and the interpreter is already finalizing,
taking the GIL ends the thread with a forced unwind and the whole process aborts ("terminate called
without an active exception"), after training finished correctly. Keeping the last few Works referenced
here turns the worker's release into a plain decrement; Python frees them later, holding the GIL.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Optional

import torch.distributed as dist

__all__ = ["settle"]

# A Work is surely released by the backend long before 64 newer collectives have completed.
_SETTLED: Deque[Any] = collections.deque(maxlen=64)


def settle(work: Optional[dist.Work]) -> None:
    """Wait for `work` (from a collective called with async_op=True) and keep it referenced a while."""
    if work is None:
        return
    work.wait()
    _SETTLED.append(work)
