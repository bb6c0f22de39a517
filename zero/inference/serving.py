"""Serving weights straight from the checkpoint's safetensors files instead of copying them into swap files.

On the NVMe tier, a partition whose values are the bytes of checkpoint tensors as they are stored - the
tensor's dtype is the model's compute dtype, the unit is not quantized - is read from the checkpoint file
at each use (zero.stage3.served.ServedPartition): no swap file is written for it, so a load takes the
time to read the headers instead of the time to copy the model. The rest (tensors cast to another dtype,
quantized units, partitions kept in host memory by max_in_cpu) is copied as before.

When (`serve_checkpoint=` of zero.from_pretrained):

- "auto" (the default): served, unless the config has an optimizer block (training writes the weights
  back), the machine is big-endian (safetensors is little-endian), a swap cache is asked for
  (`swap_cache=`: it exists to keep copies of the weights), or a checkpoint file lies on a
  filesystem that is slow for random reads: a network or FUSE filesystem (NFS, SMB/CIFS, Ceph, Lustre,
  GlusterFS, 9p, FUSE mounts such as sshfs or s3fs), or a rotational disk while `offload_param.nvme_path`
  is on a non-rotational one. Then the weights are copied into swap files on `nvme_path` once.
- True: served whatever the filesystem, also with a swap cache (which then holds only the partitions that
  are converted); the optimizer and byte-order rules still apply.
- False: always copied (the swap files hold every partition on NVMe).

The decision and the bytes served are in `LoadReport` (`checkpoint_bytes_served`, `copy_reason`).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from offload.config import ZeroOffloadConfig
from zero.inference.checkpoint_files import CheckpointTensor
from zero.inference.weight_plan import WeightPlan
from zero.stage3.served import CheckpointFds, Extent, ServedPartition
from zero.stage3.unit import Unit

__all__ = ["SERVE_CHOICES", "PartitionServer", "disk_note", "serve_decision"]

SERVE_CHOICES = ("auto", True, False)
# safetensors dtype name -> the torch dtype whose bytes it stores
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# filesystems slow for a forward's random reads (by /proc/self/mountinfo's type; "fuse*" too)
_REMOTE_FS = frozenset(
    ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "glusterfs", "9p", "afs", "gpfs", "beegfs")
)


def _fs_type(dev: int) -> Optional[str]:
    """The type of the mounted filesystem whose device number is `dev` (/proc/self/mountinfo), or None."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return None


def _rotational(dev: int) -> bool:
    """Whether the block device `dev` (or the disk its partition is on) is rotational (sysfs)."""
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (os.path.join(base, "queue", "rotational"), os.path.join(base, "..", "queue", "rotational")):
        try:
            with open(queue, encoding="ascii") as f:
                return f.read().strip() == "1"
        except OSError:
            continue
    return False


def disk_note(fd: int, path: str, swap_dir: str) -> Optional[str]:
    """Why the file open as `fd` is on a disk too slow to serve weights from, or None: a network or FUSE
    filesystem, or a rotational disk while the swap directory `swap_dir` is on a non-rotational one
    (virtual machines' disks often call themselves rotational: only the difference counts)."""
    dev = os.fstat(fd).st_dev
    fs = _fs_type(dev)
    if fs is not None and (fs in _REMOTE_FS or fs.startswith("fuse")):
        return f"{path} is on a {fs} filesystem"
    try:
        swap_dev = os.stat(swap_dir).st_dev
    except OSError:
        return None
    if swap_dev != dev and _rotational(dev) and not _rotational(swap_dev):
        return f"{path} is on a rotational disk and {swap_dir} is not"
    return None


def serve_decision(
    serve: Union[bool, str], loaded: ZeroOffloadConfig, held: CheckpointFds, swap_cache: bool = False
) -> Tuple[bool, Optional[str]]:
    """(whether partitions on NVMe may be served from the checkpoint, why not when they may not: None when
    there is no NVMe tier to serve), by the module's rule; `swap_cache`: a swap cache was asked for."""
    if serve not in SERVE_CHOICES or isinstance(serve, str) and serve != "auto":
        raise ValueError(f"serve_checkpoint must be 'auto', True or False, got {serve!r}")
    off = loaded.zero_optimization.offload_param
    if off is None or off.device != "nvme":
        return False, None
    if serve is False:
        return False, "serve_checkpoint=False"
    if loaded.optimizer is not None:
        return (
            False,
            "the config has an optimizer block: training writes the weights back, so they are copied",
        )
    if sys.byteorder != "little":
        return False, "safetensors files are little-endian and this machine is not"
    if serve == "auto" and swap_cache:
        return False, "swap_cache= keeps copies of the weights (serve_checkpoint=True serves them instead)"
    if serve == "auto":
        for path in held.paths:
            note = disk_note(held.fd(path), path, os.fspath(off.nvme_path or "."))
            if note is not None:
                return False, note + " (serve_checkpoint=True serves it anyway)"
    return True, None


class PartitionServer:
    """`store.serve_from`'s callback: a unit's ServedPartition when every checkpoint tensor of its
    parameters holds exactly the bytes of the parameter (same dtype), else None (its partition is copied,
    and the reason counted in `copied`)."""

    def __init__(
        self,
        model: nn.Module,
        plan: WeightPlan,
        tensors: Mapping[str, CheckpointTensor],
        held: CheckpointFds,
    ) -> None:
        """`held`: the descriptors the extents read (the store's own, kept until it closes)."""
        # by every name of a parameter (a tied one has several; the unit names it by one of them): the
        # partitioner replaces the meta parameters, so names are what stays
        named = list(model.named_parameters(remove_duplicate=False))
        first = {name: key for key, (_, name) in plan.params.items()}
        by_id = {id(p): first[name] for name, p in named if name in first}
        self._keys: Dict[str, str] = {name: by_id[id(p)] for name, p in named if id(p) in by_id}
        self._tensors = tensors
        self._held = held
        self.copied: Dict[str, int] = {}  # reason -> units

    def __call__(self, unit: Unit) -> Optional[ServedPartition]:
        """The unit's partition as extents of checkpoint files, or None (see the class)."""
        es = unit.element_size
        extents: List[Extent] = []
        for i, name in enumerate(unit.param_names):
            key = self._keys.get(name)
            if key is None:
                continue  # not in the checkpoint (an ignorable missing parameter): zeros, as when copied
            t = self._tensors[key]
            stored = _TORCH_DTYPES.get(t.dtype)
            if stored != unit.dtype:
                reason = f"{t.dtype} tensors cast to {str(unit.dtype).replace('torch.', '')}"
                self.copied[reason] = self.copied.get(reason, 0) + 1
                return None
            lo, hi = unit.share(i)  # this rank's elements of the parameter, at part_offsets[i]
            if lo < hi:
                fd = self._held.fd(t.file)
                at = unit.part_offsets[i]
                extents.append(Extent(at * es, fd, t.offset + lo * es, (hi - lo) * es, t.file, key))
        return ServedPartition(unit.name, extents, unit.part_nbytes)
