"""The engine: DeepSpeed's `DeepSpeedEngine` face over every ZeRO stage, and what it answers by name.

* `engine`: `ZeroEngine` (forward, backward, step, checkpoints), composed of a layout (zero.layout), an
  optimizer state and update pass (zero.optimizer) or the inference parts (zero.inference);
* `api`: DeepSpeed's accessors and memory calls (`fp16_enabled()`, `offload_states()`, ...);
* `state_access`: per-parameter access behind `zero.utils.safe_get_full_*` / `safe_set_*`;
* `unused`: `ignore_unused_parameters: false`; `generation`: TRL's `unwrap_model_for_generation`.

`zero.initialize` (zero.initialization) builds one.
"""

from zero.engine.engine import ZeroEngine, consolidated_state_dict

__all__ = ["ZeroEngine", "consolidated_state_dict"]
