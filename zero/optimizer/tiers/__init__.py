"""Where one rank's fp32 master and optimizer states live: the tiers behind `zero.optimizer.state`.

* `base`: `StateTier`, the protocol every tier presents (callers use its members only), and `StateInfo`;
* `device`: `DeviceState`, tensors in device or pinned host memory;
* `split`: `SplitTier`, two tiers over one index space (RAM-first placement, Twin-Flow);
* `device_part`: `TorchDevicePart`, the device share of a Twin-Flow split stepped by torch, and
  `FusedDeviceStep`, torch's fused Adam over a whole state in device memory;
* `build`: `build_tier`, the tier a `TierSpec` describes (every knob given at construction).

The NVMe tier is `offload.swap.optimizer_swapper.OptimizerSwapper`.
"""
