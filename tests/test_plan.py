"""The planner (offload.estimate.plan, `ds-estimate-memory --plan`) and Hugging Face "auto" values filled
outside the Trainer (zero.engine.auto_values)."""

from __future__ import annotations

import json

import pytest
import torch
from plan_helpers import GPT125, llama7

import zero
from offload.cli.estimate_memory import run
from offload.config import load_config
from offload.estimate.machine import MachineProfile
from offload.estimate.plan import plan_training, predict_training
from offload.estimate.plan_inference import plan_inference
from offload.estimate.probe import ComputeProfile, load_compute_profile
from zero.engine.auto_values import auto_keys, fill_auto_values

GiB = 1 << 30
RATES = ComputeProfile(cpu_optimizer_elems_per_s=5e8, matmul_flops=1e11, host_copy_gbps=5.0)
GPU_RATES = ComputeProfile(
    cpu_optimizer_elems_per_s=5e8, matmul_flops=4e14, device="cuda", h2d_gbps=25.0, d2h_gbps=25.0
)
LLAMA7 = llama7(seq_len=16)


def cpu_box(ram: int) -> MachineProfile:
    return MachineProfile(
        ram_bytes=ram, nvme_free_bytes=500 * GiB, nvme_read_gbps=2.0, nvme_write_gbps=1.5, cpu_only=True
    )


def test_training_plan_config_loads_and_a_small_model_stays_in_memory() -> None:
    plan = plan_training(GPT125, cpu_box(24 * GiB), RATES, precision="fp32", max_micro_batch=2)
    cfg = load_config(plan.config)
    z = cfg.zero_optimization
    assert (z.offload_param is None or z.offload_param.device == "none") and (
        z.offload_optimizer is None or z.offload_optimizer.device != "nvme"
    )
    assert int(cfg.train_micro_batch_size_per_gpu) == plan.chosen.micro_batch == 2  # more tokens per step
    assert plan.chosen.bound == "compute" and plan.chosen.nvme_read_bytes == 0
    # no GPU: the optimizer steps on the CPU whatever offload_optimizer says
    assert plan.chosen.times["cpu optimizer"] == pytest.approx(
        GPT125.params / RATES.cpu_optimizer_elems_per_s
    )
    assert plan.chosen.seconds == pytest.approx(
        plan.chosen.times["compute"] + plan.chosen.times["cpu optimizer"]
    )


def test_a_cpu_only_machine_is_planned_as_one() -> None:
    """Host memory is the device: a 7B model in 32 GiB of RAM goes to NVMe, and no row is a GPU row."""
    plan = plan_training(LLAMA7, cpu_box(32 * GiB), RATES, precision="bf16")
    text = plan.format()
    assert "on the CPU (no GPU: host memory is the device)" in text and "GPU" not in text.replace(
        "no GPU", ""
    )
    assert "nvme" in (plan.chosen.offload_optimizer, plan.chosen.offload_param)
    assert plan.chosen.fits and plan.chosen.nvme_read_bytes > 0
    # forward and backward while the parameter reads stream, then the optimizer pass while its disk
    # traffic (the state's, the parameters' write-back) streams, then what nothing runs under
    t = plan.chosen.times
    fwd_bwd = max(t["compute"] + 0.75 * t["copies"], t["disk"])
    opt_pass = max(t["cpu optimizer"] + 0.25 * t["copies"], t["disk (optimizer pass)"])
    assert t["disk (optimizer pass)"] > 0
    assert plan.chosen.seconds == pytest.approx(fwd_bwd + opt_pass + t["disk (not overlapped)"])
    never = [c for c, why in plan.rejected if c.offload_optimizer == "none" and c.offload_param == "none"]
    assert never and all("does not fit: no (cpu" in why for c, why in plan.rejected if c in never)
    load_config(plan.config)
    # the same model with an 80 GiB GPU and 256 GiB of RAM: no NVMe needed
    gpu = MachineProfile(gpu_bytes=80 * GiB, ram_bytes=256 * GiB, nvme_read_gbps=2.0, nvme_write_gbps=1.5)
    on_gpu = plan_training(LLAMA7, gpu, GPU_RATES, precision="bf16")
    assert "nvme" not in (on_gpu.chosen.offload_optimizer, on_gpu.chosen.offload_param)
    assert "on the GPU" in on_gpu.format()


def test_the_parameter_write_back_streams_under_the_optimizer_pass() -> None:
    """Stage 3 with every parameter on NVMe: the updated partitions' writes are left in flight during the
    optimizer pass, so they are priced with the pass's disk traffic beside the update, not after it; the
    reads stream under forward and backward."""
    c = predict_training(
        GPT125,
        cpu_box(24 * GiB),
        RATES,
        stage=3,
        offload_param="nvme",
        offload_optimizer="cpu",
        precision="fp32",
        param_max_in_cpu=0,
    )
    t, nbytes = c.times, GPT125.params * 4
    assert t["disk (not overlapped)"] == 0
    assert t["disk (optimizer pass)"] == pytest.approx(nbytes / 1.5e9)  # written once
    assert t["disk"] == pytest.approx(nbytes / 2e9)  # read once (kept gathered for reuse)
    fwd_bwd = max(t["compute"] + 0.75 * t["copies"], t["disk"])
    opt_pass = max(t["cpu optimizer"] + 0.25 * t["copies"], t["disk (optimizer pass)"])
    assert c.seconds == pytest.approx(fwd_bwd + opt_pass)


def test_inference_plan_streams_only_what_the_budget_cannot_hold() -> None:
    fits = plan_inference(GPT125, cpu_box(24 * GiB), RATES, precision="fp32")
    assert fits.chosen.offload_param == "none" and fits.chosen.nvme_read_bytes == 0
    # streamed from NVMe with "auto", a model that fits the budget is read from RAM only
    kept = plan_inference(GPT125, cpu_box(24 * GiB), RATES, precision="fp32", offload_param="nvme").chosen
    assert kept.param_max_in_cpu == GPT125.params and kept.nvme_read_bytes == 0 and kept.times["disk"] == 0
    big = plan_inference(LLAMA7, cpu_box(24 * GiB), RATES, precision="fp32", pinned_budget=4 * GiB)
    c = big.chosen
    assert c.offload_param == "nvme" and c.bound == "disk"
    assert 0 < c.param_max_in_cpu * 4 <= 4 * GiB
    assert c.nvme_read_bytes == (LLAMA7.params - c.param_max_in_cpu) * 4
    assert c.seconds == pytest.approx(c.nvme_read_bytes / 2e9)
    assert load_config(big.config).zero_optimization.offload_param.max_in_cpu == "auto"


def test_cli_plan_prints_a_loadable_config_and_a_prediction(tmp_path) -> None:
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(RATES.to_dict()))
    prof = tmp_path / "machine.json"
    prof.write_text(
        json.dumps(
            {
                "ram_bytes": 32 * GiB,
                "gpu_bytes": 0,
                "nvme_free_bytes": 500 * GiB,
                "nvme_read_gbps": 2.0,
                "nvme_write_gbps": 1.5,
            }
        )
    )
    argv = ["--plan", "--params", "6.738B", "--largest-layer", "131072000", "--hidden-size", "4096"]
    argv += [
        "--num-layers",
        "32",
        "--seq-len",
        "16",
        "--machine-profile",
        str(prof),
        "--compute-profile",
        str(rates),
    ]
    text = run(argv + ["--nvme-path", str(tmp_path)])
    assert "Predicted: " in text and "bound by" in text and "Rejected:" in text
    config = json.loads(text[text.index("{") :])
    assert load_config(config).zero_optimization.stage == 3
    data = json.loads(run(argv + ["--nvme-path", str(tmp_path), "--json"]))
    assert data["config"] == config and data["predicted_seconds"] > 0
    with pytest.raises(Exception, match="--seq-len"):
        run(["--plan", "--params", "1B", "--compute-profile", str(rates)])
    with pytest.raises(ValueError, match="matmul_flops"):
        load_compute_profile({"cpu_optimizer_elems_per_s": 1.0})


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": 32, "num_hidden_layers": 2})()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _auto_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": "auto",
            "reduce_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "offload_optimizer": {"device": "auto", "max_in_cpu": "auto"},
        },
    }


def test_hf_auto_values_are_filled_from_the_model_and_the_plan() -> None:
    seen = {}

    def planner(shape, machine, **kwargs):
        seen.update(shape=shape, kwargs=kwargs)
        return plan_training(shape, cpu_box(24 * GiB), RATES, **kwargs)

    model = _Tiny().to(torch.bfloat16)
    cfg = fill_auto_values(_auto_config(), model, world_size=1, planner=planner)
    assert auto_keys(cfg) == []
    assert cfg["bf16"]["enabled"] is True and cfg["optimizer"]["params"]["betas"] == [0.9, 0.999]
    zo = cfg["zero_optimization"]
    assert zo["reduce_bucket_size"] == 32 * 32 and zo["stage3_param_persistence_threshold"] == 320
    assert zo["offload_optimizer"]["max_in_cpu"] == "auto"  # the engine's own "auto" is left to it
    assert seen["shape"].params == 32 * 32 + 32 + 32 * 4 + 4 and seen["shape"].hidden_size == 32
    assert seen["kwargs"]["allow_nvme"] is False  # no nvme_path in the config
    assert zo["stage"] in (0, 1, 2, 3) and zo["offload_optimizer"]["device"] in ("none", "cpu")
    assert (
        cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    )
    load_config(cfg)


def test_zero_initialize_fills_auto_values_outside_the_trainer(monkeypatch) -> None:
    import offload.estimate.probe as probe

    monkeypatch.setattr(probe, "probe_machine", lambda **kw: RATES)
    cfg = _auto_config()
    engine, *_ = zero.initialize(model=_Tiny(), config=cfg)
    try:
        assert engine.train_micro_batch_size_per_gpu() >= 1
        assert engine.config.zero_optimization.reduce_bucket_size == 32 * 32
        assert engine.config.zero_optimization.stage in (0, 1, 2, 3)
        x = torch.randn(2, 32)
        engine.backward(engine(x).sum())
        engine.step()
    finally:
        engine.close()
    assert cfg["zero_optimization"]["stage"] == "auto"  # the caller's dict is not changed


def test_the_reports_show_the_plans_prediction_beside_the_measurement() -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_offload": {"predicted_seconds": 0.25},
    }
    engine, *_ = zero.initialize(model=_Tiny(), config=cfg)
    try:
        engine.backward(engine(torch.randn(2, 32)).sum())
        engine.step()
        rep = engine.last_report
    finally:
        engine.close()
    assert rep.predicted_s == 0.25 and f"plan predicted 0.250 s, measured {rep.step_s:.3f} s" in rep.format()
    del cfg["optimizer"]
    engine, *_ = zero.initialize(model=_Tiny(), config=cfg)
    try:
        engine(torch.randn(2, 32))
        inf = engine.inference_report()
    finally:
        engine.close()
    assert inf.predicted_s_per_forward == 0.25 and "plan predicted 250.0 ms/forward" in inf.format()
    plan = plan_inference(GPT125, cpu_box(24 * GiB), RATES, precision="fp32")
    assert load_config(plan.config).zero_offload.predicted_seconds == pytest.approx(plan.predicted_seconds)


def test_a_plan_that_needs_the_disk_without_its_bandwidths_says_so() -> None:
    """NVMe configurations are weighed only with the disk's measured bandwidths (ds-nvme-bench's profile)."""
    from offload.estimate.errors import EstimateInputError

    no_disk_rates = MachineProfile(ram_bytes=16 * GiB, nvme_free_bytes=500 * GiB, cpu_only=True)
    with pytest.raises(EstimateInputError, match=r"disk's bandwidths .*ds-nvme-bench --json"):
        plan_training(
            LLAMA7, no_disk_rates, RATES, stages=(3,), offload_optimizer="nvme", offload_param="nvme"
        )


def test_a_given_offload_device_narrows_the_search_to_it() -> None:
    for opt in ("none", "cpu", "nvme"):
        plan = plan_training(GPT125, cpu_box(24 * GiB), RATES, stages=(2,), offload_optimizer=opt)
        assert (plan.chosen.stage, plan.chosen.offload_optimizer) == (2, opt)
        assert {c.offload_optimizer for c, _ in plan.rejected} <= {opt}


def test_auto_bucket_sizes_need_a_model_with_a_hidden_size() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"reduce_bucket_size": "auto"}}
    with pytest.raises(ValueError, match="'auto' bucket sizes need the model's hidden size"):
        fill_auto_values(cfg, torch.nn.Linear(4, 4), world_size=1)
