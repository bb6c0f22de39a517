"""Layouts: how one rank's parameters and gradients are partitioned for the optimizer.

`base` defines what the engine needs of a layout (`Layout`, and `GradMemory`, the gradient bytes a rank
allocated); `flat` is stages 0-2 (`FlatLayout`), with stage 2's gradients moved out during backward by
`grad_buckets` (`GradBuckets`); `units` is stage 3 (`UnitLayout`, on the stage-3 partitioner). The engine
imports the one its stage needs.
"""
