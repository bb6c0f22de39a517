"""zero.Init, GatheredParameters, meta-device loading and the pinned budget check of stage 3."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from stage3_helpers import MLP, GradCollector, s3_config
from torch import nn

from offload.pinned import PinnedPool
from zero.examples.models import GPT, GPTConfig
from zero.stage3 import GatheredParameters, Init, Stage3Partitioner, Stage3PinnedBudgetError

TINY_GPT = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_gpt_built_under_init_equals_plain_and_trains_bit_exact(tier, tmp_path):
    torch.manual_seed(0)
    ref = GPT(TINY_GPT)
    torch.manual_seed(0)  # Init's wrapped apply() draws the same random numbers as plain construction
    with Init(config=s3_config(tier, tmp_path)) as zi:
        model = GPT(TINY_GPT)
    assert all(p.numel() == 0 for p in model.parameters())
    col = GradCollector()
    part = Stage3Partitioner.for_model(model, grad_sink=col)  # takes the Init's partitioner over
    assert part is zi.partitioner and part.grad_sink is col
    assert part.units[0].param_names == ["tok.weight"] and part.units[0].name == "tok"
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ref_loss = ref(x, y)
    ref_loss.backward()
    for _ in range(2):
        col.grads.clear()
        loss = model(x, y)
        loss.backward()
        assert torch.equal(loss, ref_loss)
        for n, p in ref.named_parameters():
            assert torch.equal(col.grads[n], p.grad.reshape(-1)), n
    part.close()


def test_init_never_holds_more_than_the_largest_layer():
    live = {}  # id -> (weak param, bytes): parameters whose data is whole right now
    peak = [0]

    def on_register(module, name, param):
        if param is not None:
            live[id(param)] = param
        full = sum(p.numel() * p.element_size() for p in live.values() if p.numel() > 0)
        peak[0] = max(peak[0], full)

    handle = nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        with Init(config=s3_config("cpu")):
            model = MLP(d=32, h=64, n=4)
    finally:
        handle.remove()
    largest = max(sum(p.ds_numel * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.ds_numel * 4 for p in model.parameters())
    assert 0 < peak[0] <= largest < total / 3
    assert all(p.numel() == 0 for p in model.parameters())


RSS_SCRIPT = r"""
import gc, json, sys, psutil, torch
from torch import nn
from zero.stage3 import Init
d, use_init, nvme = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
cfg = {"zero_optimization": {"stage": 3, "offload_param": {
    "device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "buffer_size": d * d // 4, "buffer_count": 2}}}
rss = lambda: (gc.collect(), psutil.Process().memory_info().rss)[1]
before = rss()
with Init(config=cfg, enabled=use_init) as zi:
    model = nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(8)))
grown = rss() - before
peak = 0
if use_init:
    zi.partitioner.attach(model)
    with torch.no_grad():
        out = model(torch.ones(1, d))
    peak = zi.partitioner.peak_full_bytes
print(json.dumps({"grown": grown, "peak": peak}))
"""


def _build_in_subprocess(d: int, use_init: bool, nvme: str) -> dict:
    # glibc raises its mmap threshold after freeing a large block and then keeps freed layers in the heap;
    # a fixed threshold makes RSS show what is live, which is what this test measures.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(d), "1" if use_init else "0", nvme],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_init_rss_stays_near_one_layer_for_an_nvme_model(tmp_path):
    d = 2048  # 16 MiB per layer, 8 layers: 128 MiB of parameters
    layer = d * d * 4
    plain = _build_in_subprocess(d, False, str(tmp_path))
    init = _build_in_subprocess(d, True, str(tmp_path))
    assert plain["grown"] > 7 * layer  # the measurement sees a model built in full
    assert init["grown"] < 2 * layer, f"RSS grew by {init['grown'] / 2**20:.0f} MiB under Init"
    assert init["peak"] == layer  # forward gathers one layer at a time


def test_meta_model_loaded_shard_by_shard(tmp_path):
    torch.manual_seed(1)
    ref = MLP()
    state = ref.state_dict()
    with torch.device("meta"):
        model = MLP()
    part = Stage3Partitioner(s3_config("nvme", tmp_path))
    part.attach(model)
    names = list(state)
    for i in range(0, len(names), 3):  # three tensors per "file"
        used = part.load_state_dict_shard({n: state[n] for n in names[i : i + 3]})
        assert used == names[i : i + 3]
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with pytest.raises(ValueError, match="does not match"):
        part.load_state_dict_shard({"inp.weight": torch.zeros(3)})
    part.close()


def test_meta_model_on_nvme_writes_nothing_until_loaded(tmp_path):
    """The zero partitions of a meta-device model are not written: a new swap file reads as zeros."""
    with torch.device("meta"):
        model = MLP()
    part = Stage3Partitioner(s3_config("nvme", tmp_path))
    part.attach(model)
    assert part.units and all(part.store.on_nvme(u) for u in part.units)
    assert part.take_io_report().param_nvme_write_bytes == 0
    for u in part.units:
        assert torch.equal(part.read_partition(u), torch.zeros(u.part_numel))
    part.close()


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_gathered_parameters_modify_round_trips(tier, tmp_path):
    cfg = s3_config(tier, tmp_path, offload_param={"pin_memory": True} if tier == "cpu" else {})
    with Init(config=cfg) as zi:
        model = MLP()
    zi.partitioner.attach(model)
    w, b = model.hidden[1].weight, model.hidden[1].bias
    with GatheredParameters([w, b], modifier_rank=0):
        assert w.shape == (40, 40)
        w.data.fill_(0.5)  # in place
        b.data = torch.arange(40, dtype=torch.float32)  # or replaced
    assert w.numel() == 0 and b.numel() == 0
    with GatheredParameters(model.hidden[1].parameters()):
        assert torch.equal(w, torch.full((40, 40), 0.5))
        assert torch.equal(b, torch.arange(40, dtype=torch.float32))
    with pytest.raises(ValueError, match="needs 40"):
        with GatheredParameters([b], modifier_rank=0):
            b.data = torch.zeros(39)
    zi.partitioner.close()


def test_init_disabled_leaves_modules_alone():
    with Init(config=s3_config("cpu"), enabled=False):
        m = nn.Linear(3, 3)
    assert m.weight.numel() == 9 and not hasattr(m.weight, "ds_unit")
    m2 = nn.Linear(3, 3)  # patches are gone after the block
    assert m2.weight.numel() == 9 and nn.Module.apply.__name__ == "apply"


def test_pinned_budget_too_small_for_cpu_partitions_names_the_layer():
    pool = PinnedPool(8 * 1024)
    part = Stage3Partitioner(s3_config("cpu", offload_param={"pin_memory": True}), pool=pool)
    with pytest.raises(Stage3PinnedBudgetError, match=r"'hidden\.0'.*1640 elements \(6560 bytes\)") as ei:
        part.attach(MLP(d=16, h=40, n=1))
    assert "8192 bytes" in str(ei.value)


def test_pinned_budget_too_small_for_nvme_staging_fails_before_training(tmp_path):
    pool = PinnedPool(10_000)
    cfg = s3_config("nvme", tmp_path, offload_param={"buffer_size": 100_000, "buffer_count": 2})
    part = Stage3Partitioner(cfg, pool=pool)
    with pytest.raises(Stage3PinnedBudgetError) as ei:
        part.attach(MLP(d=16, h=40, n=1))
    msg = str(ei.value)
    assert "'hidden.0'" in msg and "6560 bytes" in msg and "10000 bytes" in msg and "buffer_count=2" in msg
    assert pool.bytes_in_use == 0  # nothing half-allocated stays charged
    part.close()


def test_copy_of_a_reference_model_is_unaffected():
    ref = MLP()
    model = copy.deepcopy(ref)
    part = Stage3Partitioner(s3_config("cpu"))
    part.attach(model)
    assert all(p.numel() > 0 for p in ref.parameters())
    part.close()


def test_init_dtype_and_existing_module():
    with Init(config=s3_config("cpu"), dtype=torch.bfloat16) as zi:
        m = MLP()
    assert all(u.dtype == torch.bfloat16 for u in zi.partitioner.units)
    ref = MLP()
    w = ref.inp.weight.detach().clone()
    zi2 = Init(module=ref, config=s3_config("cpu"))
    assert ref.inp.weight.numel() == 0
    with GatheredParameters([ref.inp.weight]):
        assert torch.equal(ref.inp.weight, w)
    zi.partitioner.close()
    zi2.partitioner.close()
    del m


def test_classes_defined_inside_init_and_nested_blocks(tmp_path):
    with Init(config=s3_config("cpu")) as outer:

        class Local(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(5, 5))
                self.inner = nn.Linear(5, 2)

        a = Local()
        with Init(config=s3_config("nvme", tmp_path)) as inner:
            b = nn.Linear(7, 7)
    assert a.w.numel() == 0 and a.inner.weight.numel() == 0
    assert [u.name.split("-")[1] for u in outer.partitioner.units] == ["Linear", "Local"]
    assert b.weight.ds_unit.owner is inner.partitioner and inner.partitioner.store.on_nvme(b.weight.ds_unit)
    assert "__init__" in Local.__dict__ and not hasattr(Local.__init__, "_zo_original")  # unwrapped
    c = Local()
    assert c.w.numel() == 25
    outer.partitioner.close()
    inner.partitioner.close()


def test_gathered_state_dict_equals_plain(tmp_path):
    torch.manual_seed(3)
    ref = GPT(TINY_GPT)
    torch.manual_seed(3)
    with Init(config=s3_config("nvme", tmp_path)) as zi:
        model = GPT(TINY_GPT)
    zi.partitioner.attach(model)
    sd = zi.partitioner.gathered_state_dict(model)
    want = ref.state_dict()
    assert list(sd) == list(want)
    assert all(torch.equal(sd[k], want[k]) for k in want)
    assert zi.partitioner.live_full_bytes == 0
    zi.partitioner.close()


@pytest.mark.parametrize("source", ["env", "config"])
def test_pinned_budget_checked_when_init_model_is_attached(tmp_path, monkeypatch, source):
    cfg = s3_config("nvme", tmp_path)
    if source == "env":
        monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", "4096")
    else:
        monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", str(1 << 40))  # the config key wins over the env
        cfg["zero_offload"] = {"pinned_budget_bytes": 4096}
    with Init(config=cfg) as zi:
        model = MLP(d=16, h=40, n=1)
    with pytest.raises(Stage3PinnedBudgetError, match="4096 bytes"):
        zi.partitioner.attach(model)
    zi.partitioner.close()


def test_init_remote_device_overrides_the_config(tmp_path):
    with Init(config=s3_config("none"), remote_device="cpu", pin_memory=True) as zi:
        m = nn.Linear(4, 4)
    assert zi.partitioner.store.tier == "cpu" and zi.partitioner.store.pin_memory
    assert zi.partitioner.store.pool.bytes_in_use >= 20 * 4
    zi.partitioner.close()
    assert m.weight.numel() == 0
    with pytest.raises(ValueError, match="nvme_path"):
        Init(config=s3_config("none"), remote_device="nvme")


def test_for_model_reuses_the_init_partitioner_and_refuses_mixed_ones(tmp_path):
    with Init(config=s3_config("cpu")) as zi:
        model = MLP()
    part = Stage3Partitioner.for_model(model, s3_config("nvme", tmp_path))
    assert part is zi.partitioner and part.hooks is not None
    part.close()
    with Init(config=s3_config("cpu")):
        a = nn.Linear(2, 2)
    with Init(config=s3_config("cpu")):
        b = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="2 different partitioners"):
        Stage3Partitioner.for_model(nn.Sequential(a, b))
    fresh = Stage3Partitioner.for_model(MLP(), s3_config("cpu"))
    assert fresh.hooks is not None and len(fresh.units) == 5
    fresh.close()


def test_model_persistence_threshold_caps_persistent_units():
    cfg = s3_config("cpu", stage3_param_persistence_threshold=10_000, stage3_model_persistence_threshold=2400)
    part = Stage3Partitioner.for_model(MLP(), cfg)
    # units of 680, 1640, 1640, 1640, 164 elements: 680 + 1640 fit under 2400, nothing more (2320 + 164)
    assert [u.persistent for u in part.units] == [True, True, False, False, False]
    part.close()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_model_built_under_init_has_hf_initial_weights(family):
    """transformers 5 initialises weights with its own `smart_apply`, not `nn.Module.apply`: Init gathers
    around it too, so the partitioned model starts from exactly the weights plain transformers gives it."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
        )
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    ref = cls(cfg)
    torch.manual_seed(0)
    with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = cls(cfg)
    with GatheredParameters(list(model.parameters())):
        got = {k: v.clone() for k, v in model.state_dict().items()}
    want = ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not hasattr(nn.Module, "smart_apply") or nn.Module.smart_apply.__module__ != "zero.stage3.init"
