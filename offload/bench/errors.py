"""Errors the benchmark reports to the user as one line."""

from __future__ import annotations


class BenchError(Exception):
    """Bad input or an unusable environment (path, size, grid, full disk): exit status 2."""


class VerificationError(Exception):
    """Data read back differs from what was written: the I/O path is broken, exit status 1."""
