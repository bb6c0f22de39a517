"""Parameter counts from a model: total (tied weights once) and the largest single module.

Models are built on the meta device, so counting a 100B-parameter model allocates no parameter memory.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

from .errors import EstimateInputError

if TYPE_CHECKING:  # torch is imported only when a model is built: --params alone starts fast
    import torch


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a model: total, trainable, largest layer and where they came from."""

    params: int
    largest_layer_params: int
    largest_layer_name: str  # "" for the root module


def _storage_key(param: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    # Meta tensors have no storage (every data_ptr is 0), so only identity can dedupe them.
    if param.device.type == "meta":
        return None
    return (param.untyped_storage().data_ptr(), param.storage_offset(), param.numel())


def count_parameters(model: torch.nn.Module) -> ParamCount:
    """Count the model's parameters, each shared tensor once.

    Tied weights (the same Parameter reachable from two modules, or two Parameters viewing the same
    storage at the same offset) count once. The largest layer is the module whose own parameters
    (recurse=False) hold the most elements: ZeRO-3 gathers one module's parameters at a time.
    """
    seen_ids = set()
    seen_storage = set()
    total = 0
    for param in model.parameters():  # already unique by identity
        if id(param) in seen_ids:
            continue
        seen_ids.add(id(param))
        key = _storage_key(param)
        if key is not None:
            if key in seen_storage:
                continue
            seen_storage.add(key)
        total += param.numel()

    largest, largest_name = 0, ""
    for name, module in model.named_modules():
        own: Dict[int, int] = {id(p): p.numel() for p in module.parameters(recurse=False)}
        size = sum(own.values())
        if size > largest:
            largest, largest_name = size, name
    return ParamCount(params=total, largest_layer_params=largest, largest_layer_name=largest_name)


def _load_callable(spec: str) -> Callable[[], object]:
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise EstimateInputError(f"--model {spec}: expected module:callable (e.g. mypkg.models:build)")
    try:
        if module_part.endswith(".py") or os.sep in module_part:
            path = os.path.abspath(module_part)
            if not os.path.isfile(path):
                raise EstimateInputError(f"--model {spec}: no such file {path}")
            name = "_ds_estimate_model_" + os.path.splitext(os.path.basename(path))[0]
            file_spec = importlib.util.spec_from_file_location(name, path)
            if file_spec is None or file_spec.loader is None:
                raise EstimateInputError(f"--model {spec}: cannot import {path}")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:  # an importable module, found on sys.path as it is (a file in the current directory: ./x.py)
            module = importlib.import_module(module_part)
    except EstimateInputError:
        raise
    except Exception as exc:  # any import-time failure is the user's model file: report it in one line
        raise EstimateInputError(
            f"--model {spec}: cannot import {module_part}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        func = getattr(module, attr)
    except AttributeError as exc:
        raise EstimateInputError(f"--model {spec}: {module_part} has no attribute {attr!r}") from exc
    if not callable(func):
        raise EstimateInputError(f"--model {spec}: {module_part}.{attr} is not callable")
    return func


def build_on_meta(factory: Callable[[], object], what: str) -> torch.nn.Module:
    """Call factory() with torch.device("meta") as the default device and check it returns a Module."""
    import torch

    try:
        with torch.device("meta"):
            model = factory()
    except EstimateInputError:
        raise
    except Exception as exc:
        raise EstimateInputError(
            f"--model {what}: building the model failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise EstimateInputError(f"--model {what}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def read_json_file(path: str, what: str) -> object:
    """json.load with one-line errors naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError as exc:
        raise EstimateInputError(f"{what} {path}: no such file") from exc
    except OSError as exc:
        raise EstimateInputError(f"{what} {path}: cannot read: {exc.strerror} (errno {exc.errno})") from exc
    except json.JSONDecodeError as exc:
        raise EstimateInputError(
            f"{what} {path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
        ) from exc
    except UnicodeDecodeError as exc:
        raise EstimateInputError(f"{what} {path}: not valid JSON (not UTF-8 text)") from exc


def hf_config_path(spec: str) -> Optional[str]:
    """The config.json that --model names, or None when spec is not a Hugging Face config."""
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        return os.path.join(spec, "config.json")
    if spec.endswith(".json"):
        return spec
    return None


def build_hf_model_on_meta(config_path: str) -> torch.nn.Module:
    """Build a Hugging Face model from its config.json on the meta device (needs transformers)."""
    config_dict = read_json_file(config_path, "--model")
    if not isinstance(config_dict, dict):
        raise EstimateInputError(
            f"--model {config_path}: expected a JSON object (a Hugging Face config.json)"
        )
    try:
        import transformers
    except ImportError as exc:
        raise EstimateInputError(
            f"--model {config_path}: building a model from a Hugging Face config needs transformers: "
            "pip install transformers (or pass --params and --largest-layer)"
        ) from exc
    model_type = config_dict.get("model_type")
    if not model_type:
        raise EstimateInputError(
            f"--model {config_path}: no 'model_type' key, not a Hugging Face config.json"
        )
    try:
        kwargs = {k: v for k, v in config_dict.items() if k != "model_type"}
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise EstimateInputError(
            f"--model {config_path}: transformers cannot read it: {type(exc).__name__}: {exc}"
        ) from exc

    def factory() -> object:
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (e.g. an encoder): the base model has the same parameters
            return transformers.AutoModel.from_config(config)

    return build_on_meta(factory, config_path)


def load_model_on_meta(spec: str) -> torch.nn.Module:
    """--model: a Hugging Face config.json (or its folder) or module:callable, built on meta."""
    config_path = hf_config_path(spec)
    if config_path is not None:
        return build_hf_model_on_meta(config_path)
    if ":" in spec:
        return build_on_meta(_load_callable(spec), spec)
    raise EstimateInputError(
        f"--model {spec}: expected a Hugging Face config.json (or a folder with one) or module:callable"
    )


# Activation shape keys in Hugging Face configs, by the names different model families use.
_HF_SHAPE_KEYS = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}


def hf_activation_shape(spec: str) -> Dict[str, int]:
    """hidden_size, num_layers, num_heads, vocab_size from a Hugging Face config.json, where present."""
    config_path = hf_config_path(spec)
    if config_path is None:
        return {}
    config = read_json_file(config_path, "--model")
    if not isinstance(config, dict):
        return {}
    shape = {}
    for ours, keys in _HF_SHAPE_KEYS.items():
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                shape[ours] = value
                break
    return shape
