"""Measuring the storage tier chain: NVMe sweep, copy bandwidths, fio comparison, machine profile, plot.

`ds-nvme-bench` (offload.cli.nvme_bench) drives these modules; `profile.load_machine_profile` is what other
tools (the memory estimator) use to read the profile it writes.
"""
