"""The example model's old home: `zero.examples.models` under the name earlier releases documented.

Importing it warns (DeprecationWarning) and gives the same objects; import `zero.examples.models` instead.
"""

import warnings

from zero.examples.models import GPT, GPTConfig, config_for_params, corpus_bytes, get_batch

__all__ = ["GPT", "GPTConfig", "config_for_params", "corpus_bytes", "get_batch"]

warnings.warn(
    "zero.models moved to zero.examples.models; the old name will be removed in a later release",
    DeprecationWarning,
    stacklevel=2,
)
