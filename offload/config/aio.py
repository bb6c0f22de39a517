"""The ``"aio"`` section: DeepSpeed's async-I/O keys and defaults, plus our ``backend`` choice."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ._reader import ConfigError, Context, Section, read_json_file

AIO_BACKENDS = ("auto", "io_uring", "aio", "psync")

# DeepSpeed's newer "io_backend" key names the library, not the kernel interface. "async_io" means "the
# fastest asynchronous path", which is what our "auto" picks; "posix" means plain pread/pwrite.
_DS_IO_BACKEND = {
    "async_io": "auto",
    "aio": "auto",
    "async": "auto",
    "deepnvme": "auto",
    "posix": "psync",
    "sync": "psync",
    "simple": "psync",
}

# The I/O core's limits, as (lowest, highest) per key. They are checked here, when the config is loaded, so
# that a value the core would refuse fails before training instead of at the first NVMe swap or checkpoint.
# The core checks the same bounds in zo::Handle's constructor (aio_csrc/handle.cpp: kMaxBlockSize and the
# queue_depth / intra_op_parallelism checks) and again in the pybind11 Handle (aio_csrc/bindings.cpp).
# offload._aio does not export them, so this table is their only Python copy; tests/test_config_bounds.py
# builds real Handles at both ends of every range, so a change on either side fails there.
AIO_LIMITS: Mapping[str, Tuple[int, int]] = MappingProxyType(
    {
        "block_size": (1, 1 << 30),
        "queue_depth": (1, 4096),
        "intra_op_parallelism": (1, 256),
    }
)

_AIO_LIMIT_REASON = {
    "block_size": "the I/O core's limit on bytes per request: 1 byte to 1 GiB",
    "queue_depth": "the I/O core's limit on requests in flight per I/O thread",
    "intra_op_parallelism": "the I/O core's limit on I/O threads per handle",
}

_AIO_KEYS = (
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "thread_count",
    "single_submit",
    "overlap_events",
    "use_gds",
    "backend",
    "io_backend",
)


@dataclass(frozen=True)
class AioConfig:
    """Async I/O settings for NVMe swapping; the field names are DeepSpeed's ``"aio"`` keys."""

    block_size: int = 1048576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    backend: str = "auto"

    @classmethod
    def from_dict(cls, d: Union[Mapping[str, Any], None], *, source: str = "<dict>") -> AioConfig:
        """Validate the inner ``{...}`` of an ``"aio"`` section (None or {} gives the defaults)."""
        return parse_aio(d, Context(source), "aio")

    def to_dict(self) -> Dict[str, Any]:
        """The settings as a dict of DeepSpeed's `aio` keys."""
        return dataclasses.asdict(self)

    def handle(self) -> Any:
        """A new `offload.aio.AioHandle` with these settings (the caller closes it)."""
        from offload.aio import AioHandle

        return AioHandle(
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
            intra_op_parallelism=self.intra_op_parallelism,
            backend=self.backend,
        )


def parse_aio(raw: Any, ctx: Context, path: str = "aio") -> AioConfig:
    """Validate the `aio` section (`raw`, at `path`) into an AioConfig; ConfigError naming the key
    otherwise."""
    s = Section(raw, path, ctx, _AIO_KEYS)
    # "thread_count" is DeepSpeed's old name for intra_op_parallelism; DeepSpeed lets the new key win when
    # both are given, which hides typos, so a disagreement is an error here.
    threads = _limited(s, "thread_count", None, limit="intra_op_parallelism")
    parallelism = _limited(s, "intra_op_parallelism", None)
    if threads is not None and parallelism is not None and threads != parallelism:
        raise s.fail(
            "intra_op_parallelism",
            f"{parallelism} disagrees with {s.key('thread_count')} = {threads} (its old name); give one",
        )
    intra = parallelism if parallelism is not None else (threads if threads is not None else 1)

    backend = s.choice("backend", AioConfig.backend, AIO_BACKENDS)
    if s.has("io_backend"):
        io_backend = s.choice("io_backend", "async_io", tuple(_DS_IO_BACKEND))
        if s.has("backend"):
            raise s.fail(
                "io_backend",
                f"give either '{s.key('backend')}' or DeepSpeed's '{s.key('io_backend')}', not both",
            )
        backend = _DS_IO_BACKEND[io_backend]

    use_gds = s.bool("use_gds", AioConfig.use_gds)
    if use_gds:
        raise s.not_supported("use_gds", "GPUDirect Storage (use_gds: true)")

    return AioConfig(
        block_size=_limited(s, "block_size", AioConfig.block_size),
        queue_depth=_limited(s, "queue_depth", AioConfig.queue_depth),
        intra_op_parallelism=intra,
        single_submit=s.bool("single_submit", AioConfig.single_submit),
        overlap_events=s.bool("overlap_events", AioConfig.overlap_events),
        use_gds=use_gds,
        backend=backend,
    )


def _limited(s: Section, name: str, default: Optional[int], *, limit: Optional[str] = None) -> Any:
    """An integer key within the I/O core's range for ``limit`` (default: the key itself)."""
    limit = limit or name
    lo, hi = AIO_LIMITS[limit]
    return s.int(name, default, min=lo, max=hi, allow_none=default is None, why=_AIO_LIMIT_REASON[limit])


def validate_aio_section(d: Union[Mapping[str, Any], str, os.PathLike]) -> AioConfig:
    """Check a written ``{"aio": {...}}`` document (a dict or a JSON file path) and return its AioConfig.

    Tools that tune the aio settings write such a file for the user to merge into their DeepSpeed config;
    this checks it with exactly the rules ``load_config`` applies to the same section.
    """
    if isinstance(d, (str, os.PathLike)):
        source = os.fspath(d)
        d = read_json_file(source)
    else:
        source = "<dict>"
    ctx = Context(source)
    top = Section(d, "", ctx, ("aio",))
    if not top.has("aio"):
        raise ConfigError(f"{source}: expected an object with an 'aio' key, e.g. {json.dumps({'aio': {}})}")
    return parse_aio(top.get("aio"), ctx, "aio")
