"""The optimizer side of the engine: update rules, the fp32 master and optimizer states on their tier, the
optimizer pass, loss scaling and learning-rate schedules.

* `rules`: the update rules (Adam, AdamW, Adagrad, Lion, ...) and `ZeroOptimizer`, the torch face;
* `state`: `OptimizerState`, one rank's master and states on a tier (`tiers`: device/pinned memory,
  NVMe, a split between two, the device share of Twin-Flow);
* `update` / `overlap`: one optimizer pass, after backward or during it;
* `param_groups`, `state_convert`, `integrity`, `loss_scaler`, `schedulers`.
"""
