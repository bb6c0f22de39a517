"""The machine profile (what `ds-nvme-bench --json` writes and `ds-estimate-memory --machine-profile` reads)
and the `aio` config section (what `--write-config` writes and the engine loads unchanged)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional, Tuple

from .grid import AioParams

PROFILE_VERSION = 1

# name -> accepted types; None in the tuple means the field may be null (not measured on this machine).
PROFILE_FIELDS: Dict[str, Tuple[Any, ...]] = {
    "ram_bytes": (int,),
    "gpu_bytes": (int,),
    "nvme_path": (str,),
    "nvme_free_bytes": (int,),
    "nvme_read_gbps": (float, int, type(None)),
    "nvme_write_gbps": (float, int, type(None)),
    "host_copy_gbps": (float, int, type(None)),
    "h2d_gbps": (float, int, type(None)),
    "d2h_gbps": (float, int, type(None)),
    "best_aio": (dict, type(None)),
    "created": (str,),
}


class ProfileError(ValueError):
    """A machine profile file that cannot be used; the message names the file and the field."""


def filesystem_of(path: str) -> Tuple[str, str]:
    """(mount point, filesystem type) of `path`, from /proc/self/mounts; ('?', '?') where unknown."""
    real = os.path.realpath(path)
    found = ("?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(
                    found[0]
                ):
                    found = (mount, fields[2])
    except OSError:
        pass
    return found


def free_bytes(path: str) -> int:
    """Free bytes on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize  # what an unprivileged writer may use, not the root reserve


def ram_bytes() -> int:
    """Total RAM of the machine in bytes."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def utc_now() -> str:
    """The current UTC time as an ISO 8601 string."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def aio_section(params: AioParams) -> Dict[str, Any]:
    """`{"aio": {...}}` with exactly the schema's keys and types: the schema parses the measured settings
    and its own AioConfig is written back, so every key it knows is present (use_gds: false included) and
    loading the file gives an equal AioConfig."""
    from offload.config import validate_aio_section

    config = validate_aio_section({"aio": params.as_dict()})
    section = config.to_dict()
    mismatched = [k for k, v in params.as_dict().items() if section.get(k) != v]
    if mismatched:  # the schema rewrote a measured value: writing it would not be what was measured
        raise ValueError(f"config schema changed measured aio keys {mismatched}: {section}")
    return {"aio": section}


def write_json(payload: Dict[str, Any], path: str, overwrite: bool = True) -> None:
    """Write atomically (temporary file in the same directory, fsync, rename): an interrupted run never leaves
    half a file. With `overwrite` false an existing file is kept and BenchError raised."""
    from .outputs import write_atomically

    text = json.dumps(payload, indent=2) + "\n"  # serialised first: a bad value cannot leave a file behind
    write_atomically(path, lambda f: f.write(text.encode()), overwrite=overwrite)


def load_machine_profile(path: str) -> Dict[str, Any]:
    """Read and check a profile: every field of PROFILE_FIELDS present with the right type."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ProfileError(f"machine profile {path}: cannot read: {e.strerror} (errno {e.errno})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"machine profile {path}: invalid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"machine profile {path}: expected a JSON object")
    for name, types in PROFILE_FIELDS.items():
        if name not in data:
            raise ProfileError(f"machine profile {path}: missing field '{name}'")
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            allowed = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ProfileError(f"machine profile {path}: field '{name}' must be {allowed}, got {value!r}")
    return data


def build_profile(
    *,
    nvme_path: str,
    size: int,
    repeats: int,
    direct_io: bool,
    read_gbps: Optional[float],
    write_gbps: Optional[float],
    best_aio: Optional[AioParams],
    best_read: Optional[AioParams],
    best_write: Optional[AioParams],
    copies: Any,
    results: Any,
    fio: Any,
    notes: Any,
    buffer: Dict[str, Any],
) -> Dict[str, Any]:
    """The machine profile the bench writes: the best read and write parameters with their bandwidths, plus
    machine facts."""
    mount, fstype = filesystem_of(nvme_path)
    return {
        "profile_version": PROFILE_VERSION,
        "created": utc_now(),
        "hostname": os.uname().nodename,
        "ram_bytes": ram_bytes(),
        "gpu_bytes": int(copies.gpu_bytes),
        "gpu_name": copies.gpu_name,
        "nvme_path": os.path.abspath(nvme_path),
        "nvme_mount": mount,
        "nvme_filesystem": fstype,
        "nvme_free_bytes": free_bytes(nvme_path),
        "nvme_read_gbps": read_gbps,
        "nvme_write_gbps": write_gbps,
        "host_copy_gbps": copies.host_copy_gbps,
        "h2d_gbps": copies.h2d_gbps,
        "d2h_gbps": copies.d2h_gbps,
        "h2d_pageable_gbps": copies.h2d_pageable_gbps,
        "d2h_pageable_gbps": copies.d2h_pageable_gbps,
        "best_aio": best_aio.as_dict() if best_aio else None,
        "best_aio_read": best_read.as_dict() if best_read else None,
        "best_aio_write": best_write.as_dict() if best_write else None,
        "direct_io": direct_io,
        "size_bytes": size,
        "repeats": repeats,
        "buffer": buffer,
        "results": results,
        "fio": fio,
        "notes": list(notes),
    }
