"""zero-to-fp32: write the fp32 weights of a zero-offload checkpoint as safetensors (or a torch .bin).

    zero-to-fp32 ckpt out/                         # the `latest` checkpoint -> out/model.safetensors
    zero-to-fp32 ckpt model.bin --tag global_step100 --dtype bf16 --no-safetensors

Also `python -m zero.checkpoint.to_fp32 ...`. Exit status: 0 done, 2 bad input (a missing or damaged
checkpoint, bad arguments, an output holding an earlier export without --force), with one line on stderr
naming the file or key. The work is
`zero.checkpoint.to_fp32.convert_zero_checkpoint_to_fp32_state_dict`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from offload.cli.pipe import quiet_broken_pipe
from zero.checkpoint.to_fp32 import DTYPES, convert_zero_checkpoint_to_fp32_state_dict
from zero.errors import CheckpointError

PROG = "zero-to-fp32"
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zero-to-fp32` (DeepSpeed's spellings of the options are accepted too)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Consolidate the fp32 master weights of a zero-offload checkpoint (any ZeRO stage, "
        "optimizer states in memory or on NVMe, any number of ranks) into one state dict; no GPU needed.",
    )
    p.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding `latest`)")
    p.add_argument(
        "output",
        help="a directory (model.safetensors / pytorch_model.bin, or shards and an index, in it) or a "
        "file name with an extension: .safetensors, or with --no-safetensors e.g. .bin / .pt",
    )
    p.add_argument("-t", "--tag", help="the checkpoint to convert (default: the one `latest` names)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the output (default fp32)")
    p.add_argument(
        "--no-safetensors", action="store_true", help="write a torch .bin (torch.save) instead of safetensors"
    )
    p.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        default="5GB",
        help="split the output into shards of at most this size, e.g. 5GB (default), 500MB, 2GiB",
    )
    p.add_argument(
        "--exclude-frozen-parameters",
        "--exclude_frozen_parameters",
        action="store_true",
        help="leave out parameters the optimizer did not train",
    )
    p.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="replace the weights of an earlier export in OUTPUT (its model*.safetensors / "
        "pytorch_model*.bin files and index are removed first; other files stay). Without it such an output "
        "is refused",
    )
    return p


@quiet_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `zero-to-fp32` with `argv`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output,
            tag=args.tag,
            dtype=args.dtype,
            safe_serialization=not args.no_safetensors,
            max_shard_size=args.max_shard_size,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            force=args.force,
        )
    except (CheckpointError, OSError, ValueError, ImportError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
