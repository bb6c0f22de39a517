"""The one exception type the estimator raises for bad input, so the CLI can print it as one line."""


class EstimateInputError(ValueError):
    """Bad input to the estimator: the message names what was wrong (flag, file, key, value)."""
