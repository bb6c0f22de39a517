"""Integrations with training frameworks, one module each, imported only on request.

`zero.integrations.lightning`: `ZeroStrategy`, a PyTorch Lightning strategy (registered as
`Trainer(strategy="zero_offload")` when the module is imported); `zero.integrations.transformers`:
`ZeroTrainer`, the Hugging Face `Trainer` through the engine (docs/integrations.md). Importing this package
imports no framework: each integration module imports its framework itself.
"""
