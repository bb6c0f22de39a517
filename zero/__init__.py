"""ZeRO partitioning and the offload engine."""
