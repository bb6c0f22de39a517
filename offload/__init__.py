"""zero-offload memory tiers: async NVMe I/O, pinned host buffers, CPU optimizers, memory estimates."""

__version__ = "0.1.0"
