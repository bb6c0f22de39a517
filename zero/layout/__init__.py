"""Layouts: how one rank's parameters and gradients are partitioned for the optimizer.

`base` defines what the engine needs of a layout (`Layout`); `flat` is stages 0-2 (`FlatLayout`), `units`
is stage 3 (`UnitLayout`, on the stage-3 partitioner). The engine imports the one its stage needs.
"""
