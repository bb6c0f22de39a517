"""Checkpoints that survive a crash during the save, load without running code, and resume bit for bit.

Layout of `<save_dir>/<tag>/` (format 2):

* `model_states.pt` (rank 0): module state_dict, step counters, scheduler and loss-scaler state, client
  state, the config, and `master_index`: which parameter (names, shape) each element of the fp32 master
  and of the stage-3 parameter partitions is (the layout's `master_index()`, read by `to_fp32`);
* `rank<r>_states.pt` (every rank): RNG states (torch, CUDA, numpy, python) and the optimizer's metadata
  (rule, hyperparameters, step count, partition bounds);
* stage 3: `param_rank<r>.bin`, the rank's parameter partitions in the model dtype, unit after unit
  (`rank<r>_states.pt` lists the units by their stable names); `model_states.pt` then holds only what is
  not partitioned (buffers);
* `optim_rank<r>.bin`: the rank's fp32 master and optimizer states, raw, tensor after tensor
  (`[master | state_1 | ...]`, partition-size each), streamed chunk by chunk through an aio handle;
* `pickled_states.pt` (rank 0, only when needed): a client_state or scheduler state that only pickle can
  restore; read only by `load_checkpoint(..., allow_pickle=True)`;
* `manifest.json` (rank 0, written last): format version, world size, and per file its size and xxh3_64
  checksums (computed while writing), sealed by a checksum of its own. The checksums catch corruption,
  not tampering (anyone who can edit the files can reseal them): loading trusts no field of any file.

The `.pt` files hold only tensors and plain types and load with `torch.load(weights_only=True)`.
Atomicity, permissions (0700 directories, 0600 files) and the agreement between ranks: see save.py and
load.py, and docs/engine.md.
"""

from zero.checkpoint._files import CRASH_ENV, FORMAT_VERSION
from zero.checkpoint._output import save_atomic
from zero.checkpoint.load import load_checkpoint
from zero.checkpoint.save import save_checkpoint
from zero.errors import CheckpointError, CheckpointIntegrityError, CheckpointPickleError

__all__ = [
    "CRASH_ENV",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointPickleError",
    "load_checkpoint",
    "save_atomic",
    "save_checkpoint",
]
