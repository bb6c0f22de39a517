"""DeepSpeed's `deepspeed.utils.zero_to_fp32`: the fp32 weights of a checkpoint without an engine (no GPU, no
process group). The implementation is zero.checkpoint.to_fp32; paths may be str or os.PathLike."""

from zero.checkpoint.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
