"""ZeRO-Inference: an engine without an optimizer, and Hugging Face checkpoints streamed into it.

* `parts`: the layout and no-op optimizer parts an engine without an optimizer is composed of;
* `pretrained`: `zero.from_pretrained`, a checkpoint streamed into stage-3 partitions shard by shard;
* `hub`: where a checkpoint named to `from_pretrained` lives (a directory or a Hub repository).
"""
