"""Optimizer states in 16-bit (and 8-bit) dtypes: `optimizer.params.state_dtype` / `fp32_optimizer_states`.

* The config: DeepSpeed's `fp32_optimizer_states: false` means bf16 states; `state_dtype` says it directly;
  a contradiction between the two is a ConfigError naming both.
* The engine with bf16 states gives the same weights and states, bit for bit, on every tier (device
  memory, pinned host, NVMe with one or two copies) and stage as without offload, and stays close to
  torch's AdamW (fp32 states).
* The NVMe bytes a step moves (the step report) are what the state's dtype says: an fp32 master and two
  bf16 moments are 8 bytes per element instead of 12.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model, torch_reference, train

import zero
from offload.config import ConfigError, load_config
from offload.swap.slots import StateFormat, slot_bytes
from offload.swap.space import align_up
from zero.examples.models import get_batch

STEPS = 6


def bf16_config(offload: str, tmp, stage: int, **opt_params):
    cfg = base_config(offload, tmp, stage=stage)
    cfg["optimizer"]["params"].update(opt_params or {"fp32_optimizer_states": False})
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def run(cfg, steps: int = STEPS):
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, steps)
    weights = {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}
    sd = engine.optimizer.state_dict()
    info = engine.optimizer_state_info()
    engine.close()
    return losses, weights, sd, info


def assert_same_run(a, b):
    """Same losses, weights, master and states, bit for bit."""
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    assert torch.equal(a[2]["master"], b[2]["master"])
    for x, y in zip(a[2]["states"], b[2]["states"]):
        assert x.dtype == y.dtype and torch.equal(x, y)


# ------------------------------------------------------------------------------------------------- config
def test_config_keys_agree_or_fail_naming_both():
    params = lambda **p: load_config({"optimizer": {"type": "AdamW", "params": p}}).optimizer.params  # noqa: E731
    assert params()["state_dtype"] == "fp32"
    assert params(fp32_optimizer_states=False)["state_dtype"] == "bf16"
    assert params(state_dtype="bf16")["fp32_optimizer_states"] is False
    assert params(state_dtype="bf16", stochastic_rounding=False)["stochastic_rounding"] is False
    with pytest.raises(ConfigError, match="state_dtype.*fp32_optimizer_states"):
        params(state_dtype="bf16", fp32_optimizer_states=True)
    with pytest.raises(ConfigError, match="state_dtype.*fp32_optimizer_states"):
        params(state_dtype="fp32", fp32_optimizer_states=False)
    with pytest.raises(ConfigError, match="stochastic_rounding"):
        params(stochastic_rounding=True)  # fp32 states: nothing to round
    with pytest.raises(ConfigError, match="state_dtype"):
        params(state_dtype="fp8")


# ------------------------------------------------------------------------------------------- numerics
@pytest.fixture(scope="module", params=["bf16", "int8"])
def bf16_reference(request):
    """States in `request.param` without offload at stage 0 (the engine's own device tier); the tests
    that use it run once per low-bit dtype."""
    return run(bf16_config("none", None, 0, state_dtype=request.param)) + (request.param,)


STATE_TENSORS = {
    "bf16": [torch.bfloat16, torch.bfloat16],
    "int8": [torch.uint8, torch.uint8, torch.float32, torch.float32],  # codes, then their absmax scales
}


def test_low_bit_states_have_their_dtype_and_stay_close_to_torch_adamw(bf16_reference):
    losses, _, sd, info, dtype = bf16_reference
    assert sd["master"].dtype == torch.float32
    assert [s.dtype for s in sd["states"]] == STATE_TENSORS[dtype]
    if dtype == "int8":
        assert [s.numel() for s in sd["states"]] == [info.numel] * 2 + [-(-info.numel // 2048)] * 2
    ref_losses, _ = torch_reference(STEPS)
    # bf16 moments keep 8 bits of mantissa, int8 ones 3 (relative to their block's largest): the
    # trajectory stays within 1e-3 of fp32 states here, while a lost or doubled step moves it by more
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-3
    assert losses != ref_losses  # and the states really were rounded


@pytest.mark.parametrize(
    "offload,stage",
    [("none", 1), ("cpu", 0), ("cpu", 2), ("nvme", 1), ("nvme", 2), ("cpu", 3), ("nvme", 3)],
)
def test_low_bit_states_on_every_tier_equal_no_offload(tmp_path, offload, stage, bf16_reference):
    dtype = bf16_reference[-1]
    got = run(bf16_config(offload, tmp_path, stage, state_dtype=dtype))
    # stage 3 partitions per module unit (another flat order of master and states): its own reference
    ref = run(bf16_config("none", None, 3, state_dtype=dtype)) if stage == 3 else bf16_reference
    assert_same_run(got, ref)
    if stage == 3:
        assert got[0] == bf16_reference[0]
        assert all(torch.equal(got[1][k], bf16_reference[1][k]) for k in got[1])


def test_state_dtype_key_equals_deepspeed_key(tmp_path):
    a = run(bf16_config("nvme", tmp_path, 2, state_dtype="bf16"))
    assert_same_run(a, run(bf16_config("nvme", tmp_path, 2, fp32_optimizer_states=False)))


def test_low_bit_nvme_one_copy_equals_no_offload(tmp_path, bf16_reference):
    cfg = bf16_config("nvme", tmp_path, 2, state_dtype=bf16_reference[-1])
    cfg["zero_optimization"]["offload_optimizer"]["nvme_copies"] = 1
    got = run(cfg)
    assert got[3].copies == 1 and got[3].state_dtype == bf16_reference[-1]
    assert_same_run(got, bf16_reference)


def test_low_bit_with_backward_overlap_equals_no_offload(tmp_path, bf16_reference):
    cfg = bf16_config("nvme", tmp_path, 2, state_dtype=bf16_reference[-1])
    cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, STEPS)
    assert engine.overlap.enabled
    weights = {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}
    sd = engine.optimizer.state_dict()
    engine.close()
    assert_same_run((losses, weights, sd), bf16_reference)


def test_cuda_fused_device_step_refuses_low_bit_states():
    """offload none on CUDA steps with torch's fused Adam, which keeps fp32 states: refused, not dropped."""
    from zero.optimizer.rules import UpdateRule
    from zero.optimizer.tiers.device_part import FusedDeviceStep

    with pytest.raises(NotImplementedError, match="state_dtype='bf16'.*offload_optimizer.device cpu or nvme"):
        FusedDeviceStep(UpdateRule("adamw", "bf16"), None, None)


def test_client_optimizer_keeps_fp32_states(tmp_path):
    """A torch optimizer passed in keeps fp32 states, whatever the ignored config block says."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    engine, *_ = zero.initialize(model=model, optimizer=opt, config=bf16_config("cpu", tmp_path, 1))
    train(engine, 1)
    assert [s.dtype for s in engine.optimizer.state_dict()["states"]] == [torch.float32] * 2
    engine.close()


def test_client_cpu_adam_with_16bit_states_gives_bf16_states(tmp_path):
    """offload.ops.CPUAdam(fp32_optimizer_states=False) passed in: bf16 states, as from the config."""
    from offload import ops

    want = run(bf16_config("none", None, 0, state_dtype="bf16"))
    model = make_model()
    opt = ops.CPUAdam(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fp32_optimizer_states=False,
    )
    cfg = base_config("none", tmp_path, stage=0)
    del cfg["optimizer"]
    engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg)
    losses = train(engine, STEPS)
    weights = {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}
    sd = engine.optimizer.state_dict()
    engine.close()
    assert_same_run((losses, weights, sd), want)


# ------------------------------------------------------------------------------------ bytes per step
@pytest.mark.parametrize("state_dtype,per_elem", [("fp32", 12), ("bf16", 8), ("int8", 6)])
def test_step_report_moves_the_dtype_bytes(tmp_path, state_dtype, per_elem):
    cfg = bf16_config("nvme", tmp_path, 2, state_dtype=state_dtype)
    cfg["zero_offload"] = {"report": True}
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    info = engine.optimizer_state_info()
    chunks = [min(info.chunk_numel, info.numel - s) for s in range(0, info.numel, info.chunk_numel)]
    if state_dtype == "int8":
        assert info.chunk_numel % 2048 == 0  # every chunk's scales start at its first element

    def region(n: int) -> int:
        # master 4 + two states of (per_elem - 4) / 2 bytes each; int8: then two fp32 absmax per 2048
        # elements, each tensor's start 64-byte aligned; the region padded to the 4 KiB alignment
        if state_dtype != "int8":
            return align_up(per_elem * n, 4096)
        codes = align_up(align_up(4 * n, 64) + n, 64) + n
        return align_up(align_up(align_up(codes, 64) + 4 * -(-n // 2048), 64) + 4 * -(-n // 2048), 4096)

    want = sum(region(n) for n in chunks)
    assert StateFormat(2, state_dtype).bytes_per_element() == per_elem + (
        8 / 2048 if state_dtype == "int8" else 0
    )
    assert info.pass_read_bytes == want
    assert info.disk_bytes == info.copies * len(chunks) * slot_bytes(info.chunk_numel, 2, 4096, state_dtype)
    for step in range(2):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        engine.step()
        assert engine.last_report.nvme_read_bytes == want
        assert engine.last_report.nvme_write_bytes == want
    engine.close()


# ------------------------------------------------------------------------------- other rules, rounding
@pytest.mark.parametrize("opt_type", ["Adagrad", "Lion"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_one_state_rules_on_nvme_equal_no_offload(tmp_path, opt_type, state_dtype):
    def cfg(offload):
        c = bf16_config(offload, tmp_path, 2)
        c["optimizer"] = {"type": opt_type, "params": {"lr": 1e-3, "state_dtype": state_dtype}}
        return c

    got, want = run(cfg("nvme")), run(cfg("none"))
    one_state = {"bf16": [torch.bfloat16], "int8": [torch.uint8, torch.float32]}[state_dtype]
    assert [s.dtype for s in want[2]["states"]] == one_state
    assert_same_run(got, want)


def test_stochastic_rounding_runs_repeatably_and_differs_from_nearest(tmp_path):
    """Stochastic rounding of bf16 states: the bits come from (step, chunk, element), so the same run
    repeats bit for bit; its states differ from round-to-nearest's (the option really ran) while the
    trajectory stays as close to fp32 states as round-to-nearest's."""
    nearest = run(bf16_config("nvme", tmp_path, 2, state_dtype="bf16"))
    cfg = bf16_config("nvme", tmp_path, 2, state_dtype="bf16", stochastic_rounding=True)
    sr = [run(cfg) for _ in range(2)]
    assert_same_run(sr[0], sr[1])
    assert any(not torch.equal(a, b) for a, b in zip(sr[0][2]["states"], nearest[2]["states"]))
    ref_losses, _ = torch_reference(STEPS)
    assert max(abs(a - b) for a, b in zip(sr[0][0], ref_losses)) < 1e-3
