"""Console entry points (declared in pyproject.toml)."""
