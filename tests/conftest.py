"""Test-wide settings.

The default run checks the CPU paths on any machine, a GPU host included: the engines compute on the CPU
(ZO_ACCELERATOR=cpu) unless the environment already names an accelerator. The GPU paths have their own
tests (test_cuda_engine.py), which ask for CUDA themselves and are skipped without it.
"""

import os

if not any(os.environ.get(var) for var in ("ZO_ACCELERATOR", "DS_ACCELERATOR")):
    os.environ["ZO_ACCELERATOR"] = "cpu"  # inherited by the tests' child processes and torchrun ranks
