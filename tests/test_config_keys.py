"""Every config key is read by the engine, or accepted-and-ignored with a warning, or refused.

The walk covers every field of every config dataclass (nested sections included): a field missing from
offload.config.usage.FIELD_USAGE, or listed there but not a field, fails. A READ field must be read by code
outside offload/config by its full path (tests/config_reads.py: `cfg.bf16.enabled` is a read of
`bf16.enabled`, not of every `enabled`); an IGNORED field warns when given with a value the engine does not
honour.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import textwrap
import typing
from typing import Any, Dict, List, Set

import pytest
from config_reads import SECTIONS, Reads, dataclass_of, via_members

from offload.config import ZeroOffloadConfig, load_config
from offload.config.usage import FIELD_USAGE, IGNORED, READ

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# READ fields checked where they are parsed (refused values), so no code outside the config package reads them
READ_WHILE_PARSING = {
    "aio.use_gds",  # true is refused while parsing
    "activation_checkpointing.cpu_checkpointing",  # resolved into offload_device while parsing
    "data_types",  # checked against the placement while parsing
    "data_types.grad_accum_dtype",  # the layouts' accumulation dtype; other values refused
    "gradient_allreduce_op",  # "mean" is what the engine does; "sum" with several ranks refused
}


def _paths(cls: Any, prefix: str = "") -> List[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        out.append(path)
        inner = dataclass_of(hints[f.name])
        if inner is not None:
            out.extend(_paths(inner, path + "."))
    return out


def _sources() -> List[str]:
    out = []
    for top in ("zero", "offload"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            if os.path.join("offload", "config") not in root:
                out += [open(os.path.join(root, f)).read() for f in files if f.endswith(".py")]
    return out


def read_paths(sources: List[str]) -> Set[str]:
    """The config paths `sources` read, with those a config class's members read for them."""
    paths = Reads(sources).run()
    via = via_members()
    grew = True
    while grew:
        grew = False
        for member, fields in via.items():
            if member in paths and not fields <= paths:
                paths |= fields
                grew = True
    return paths


def unread(paths: Set[str]) -> List[str]:
    """READ fields not in `paths`: a section counts as read when any path below it is."""

    def is_read(path: str) -> bool:
        if path in SECTIONS:
            return any(p == path or p.startswith(path + ".") for p in paths)
        return path in paths

    return [
        p for p, u in FIELD_USAGE.items() if u.kind == READ and p not in READ_WHILE_PARSING and not is_read(p)
    ]


def test_every_field_is_classified() -> None:
    fields = set(_paths(ZeroOffloadConfig))
    assert fields - set(FIELD_USAGE) == set(), "config fields with no READ/IGNORED entry"
    assert set(FIELD_USAGE) - fields == set(), "FIELD_USAGE lists paths that are not config fields"
    assert {u.kind for u in FIELD_USAGE.values()} <= {READ, IGNORED}
    assert all(u.honoured for u in FIELD_USAGE.values() if u.kind == IGNORED)


def test_read_fields_are_read_by_full_path_outside_the_config_package() -> None:
    assert unread(read_paths(_sources())) == []


def test_a_read_counts_for_its_own_path_only() -> None:
    """Reads of fields that share a leaf name (`enabled`, `device`, `nvme_path`, `buffer_count`) are told
    apart by the section they are read from, through aliases, annotations and call sites."""
    code = textwrap.dedent(
        """
        from offload.config.zero import OffloadParamConfig

        def tier(off, n):
            return off.device, off.nvme_path, n

        def build(cfg):
            zcfg = cfg.zero_optimization
            tier(zcfg.offload_optimizer, 1)
            return cfg.fp16.enabled, cfg.weight_quantization.enabled, cfg.optimizer.type

        class Store:
            def __init__(self, p: OffloadParamConfig) -> None:
                self.p = p

            def count(self) -> int:
                return self.p.buffer_count
        """
    )
    got = read_paths([code])
    want = {
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.buffer_count",
        "fp16.enabled",
        "optimizer.type",
    }
    assert want <= got
    for other in ("bf16.enabled", "zero_optimization.offload_param.device", "scheduler.type"):
        assert other not in got
    assert "zero_optimization.offload_optimizer.buffer_count" not in got
    # weight_quantization.enabled is a property: it reads what it is made of
    assert {"weight_quantization.post_init_quant", "weight_quantization.quantized_initialization"} <= got


def _config_with(path: str, value: Any) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"zero_optimization": {"stage": 2}}
    node = cfg
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if parts[1:2] == ["offload_optimizer"]:
        node.setdefault("device", "cpu")
    node[parts[-1]] = value
    return cfg


IGNORED_PATHS = sorted(p for p, u in FIELD_USAGE.items() if u.kind == IGNORED)


@pytest.mark.parametrize("path", IGNORED_PATHS)
def test_ignored_key_warns_only_when_its_value_is_not_honoured(path: str, caplog) -> None:
    usage = FIELD_USAGE[path]
    honoured = usage.honoured[0]
    other = (not honoured) if isinstance(honoured, bool) else honoured + 1
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        load_config(_config_with(path, other))
    assert f"'{path}' = {other!r} is accepted but ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        load_config(_config_with(path, honoured))
        load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert path not in caplog.text


# Section keys that are not dataclass fields: parsed for type and range, not acted on.
SECTION_KEYS = [
    ({"fp16": {"enabled": True, "fused_mode": False}}, "fp16.fused_mode"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"optimizer": {"type": "AdamW", "params": {}, "legacy_fusion": True}}, "optimizer.legacy_fusion"),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "convert_grad_on_cpu": False}}},
        "zero_optimization.offload_optimizer.convert_grad_on_cpu",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}}},
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    ),
]


@pytest.mark.parametrize("cfg,path", SECTION_KEYS)
def test_parsed_section_keys_warn_when_they_ask_for_something(cfg, path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        load_config(cfg)
    assert f"'{path}'" in caplog.text and "accepted but ignored" in caplog.text


def test_16bit_optimizer_states_are_read_while_parsing() -> None:
    for kind in ("AdamW", "Adagrad", "Lion"):
        cfg = load_config({"optimizer": {"type": kind, "params": {"fp32_optimizer_states": False}}})
        assert cfg.optimizer.params["state_dtype"] == "bf16"
        cfg = load_config({"optimizer": {"type": kind, "params": {"fp32_optimizer_states": True}}})
        assert cfg.optimizer.params["state_dtype"] == "fp32"
