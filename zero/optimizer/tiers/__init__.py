"""Where one rank's fp32 master and optimizer states live: the tiers behind `zero.optimizer.state`.

* `split`: `SplitTier`, two tiers over one index space (RAM-first placement, Twin-Flow);
* `device_part`: `TorchDevicePart`, the device share of a Twin-Flow split stepped by torch.
"""
