"""Integrations with training frameworks. Each lives in its own module and imports its framework only when
used: `zero.integrations.transformers` (the Hugging Face `Trainer`; docs/integrations.md)."""
