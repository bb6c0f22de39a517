"""ds-estimate-memory: JSON schema, config and machine-profile inputs, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from offload.cli.estimate_memory import main, run
from offload.estimate import (
    COMPONENTS,
    ActivationSettings,
    SwapBufferSettings,
    TrainingSetup,
    activation_bytes,
    estimate,
)
from offload.swap.slots import swap_chunk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "per_gpu_bytes",
    "per_cpu_bytes",
    "nvme_bytes",
    "breakdown",
}


def cli(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "offload.cli.estimate_memory", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_json_schema_and_every_valid_combination():
    proc = cli("--params", "2851e6", "--largest-layer", "32e6", "--gpus-per-node", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["params"] == 2_851_000_000 and out["largest_layer_params"] == 32_000_000
    assert len(out["rows"]) == 16  # stage 0: 1, stages 1-2: 3 each, stage 3: 9
    for row in out["rows"]:
        assert ROW_KEYS <= set(row)
        assert set(row["breakdown"]) >= {"gpu", "cpu", "nvme"}
        for tier in ("gpu", "cpu", "nvme"):
            assert list(row["breakdown"][tier]) == list(COMPONENTS)
            assert all(isinstance(v, int) and v >= 0 for v in row["breakdown"][tier].values())
        assert row["per_gpu_bytes"] == sum(row["breakdown"]["gpu"].values())
        assert row["per_cpu_bytes"] == sum(row["breakdown"]["cpu"].values())
        assert row["nvme_bytes"] == sum(row["breakdown"]["nvme"].values())
    stage0 = out["rows"][0]
    assert (stage0["stage"], stage0["per_gpu_bytes"]) == (0, 20 * 2_851_000_000)


def test_table_output_and_size_formats():
    proc = cli("--params", "1.3b", "--largest-layer", "125k", "--stage", "0")
    assert proc.returncode == 0, proc.stderr
    assert "per GPU" in proc.stdout and "per CPU" in proc.stdout and "NVMe" in proc.stdout
    assert "24.21 GiB" in proc.stdout  # 1.3e9 x 20 bytes
    assert "stage=0, offload_optimizer=none, offload_param=none" in proc.stdout


def test_deepspeed_compat_prints_deepspeed_numbers():
    args = ("--params", "2851e6", "--largest-layer", "32e6", "--gpus-per-node", "8", "--deepspeed-compat")
    proc = cli(*args, "--stage", "3")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "zero_init" in line]
    got = [(line.split("|")[0].split()[0], line.split("|")[1].split()[0]) for line in lines]
    assert got == [
        ("0.12", "71.69"),
        ("0.12", "127.45"),
        ("0.78", "63.72"),
        ("0.78", "127.45"),
        ("6.09", "1.43"),
        ("6.09", "127.45"),
    ]
    out = json.loads(run([*args, "--json"]))
    assert out["deepspeed_compat"] is True and len(out["rows"]) == 8
    assert (
        out["rows"][2]["per_cpu_bytes"] == 76_977_000_000 and out["rows"][2]["per_gpu_bytes"] == 128_000_000
    )
    assert all(ROW_KEYS <= set(row) for row in out["rows"])


def test_config_supplies_stage_offload_buffers_precision_and_batch(tmp_path):
    config = write(
        tmp_path / "ds_config.json",
        """
        {"train_micro_batch_size_per_gpu": 2,
         "bf16": {"enabled": true},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
         "zero_optimization": {"stage": 3, "sub_group_size": 1e6,
            "offload_optimizer": {"device": "nvme", "pin_memory": false, "buffer_count": 2, "max_in_cpu": 0},
            "offload_param": {"device": "cpu", "pin_memory": true}}}
        """,
    )
    args = ["--params", "1B", "--largest-layer", "10M", "--gpus-per-node", "4", "--config", config]
    out = json.loads(run([*args, "--seq-len", "128", "--hidden-size", "256", "--num-layers", "4", "--json"]))
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in out["rows"]] == [
        (3, "nvme", "cpu")
    ]
    expected = estimate(
        TrainingSetup(
            params=10**9,
            largest_layer_params=10**7,
            gpus_per_node=4,
            optimizer="adamw",
            buffers=SwapBufferSettings(
                optimizer_buffer_count=2, sub_group_size=10**6, optimizer_pin_memory=False
            ),
            activations=ActivationSettings(batch_size=2, seq_len=128, hidden_size=256, num_layers=4),
        ),
        3,
        "nvme",
        "cpu",
    ).to_dict()
    assert out["rows"][0] == expected
    row = out["rows"][0]
    # 4 ranks x (2 pinned optimizer slots x chunk x 12 B + one pageable write-back chunk x 2 B), where a
    # chunk is a third of sub_group_size (DeepSpeed's 2 x 1e6 x 4 B of staging): stage 3 writes updated
    # weights back through one chunk, not through pinned copy-back slots
    chunk = swap_chunk(10**6, 10**9 // 4, 8)
    assert chunk == 332_800
    assert row["breakdown"]["cpu"]["swap_buffers"] == 4 * (2 * chunk * 12 + chunk * 2)
    # stage 3 keeps gradient partitions in the compute dtype, pinned where the CPU optimizer reads them
    assert row["breakdown"]["cpu_pinned"]["grads_16bit"] == 10**9 * 2
    assert row["breakdown"]["cpu"]["grads_fp32"] == 0
    assert row["breakdown"]["cpu_pinned"]["params_16bit"] == 10**9 * 2
    assert row["breakdown"]["gpu"]["activations"] == activation_bytes(
        ActivationSettings(batch_size=2, seq_len=128, hidden_size=256, num_layers=4), 2
    )
    # a flag beats the config
    out = json.loads(run([*args, "--offload-optimizer", "cpu", "--json"]))
    assert [r["offload_optimizer"] for r in out["rows"]] == ["cpu"]


def test_fit_with_machine_profile_recommends_least_offload_and_predicts_io(tmp_path):
    profile = write(
        tmp_path / "machine.json",
        """
        {"gpu_bytes": 17179869184, "ram_bytes": 68719476736, "nvme_free_bytes": 1099511627776,
         "nvme_read_gbps": 3.0, "nvme_write_gbps": 2.0}
        """,
    )
    args = [
        "--params",
        "7B",
        "--largest-layer",
        "131M",
        "--sub-group-size",
        "1e8",
        "--max-in-cpu",
        "0",  # every sub-group on NVMe (the default, auto, keeps what the 32 GiB pinned budget holds)
        "--machine-profile",
        profile,
    ]
    out = json.loads(run([*args, "--json"]))
    rec = out["recommended"]
    # 16 GiB GPU, 64 GiB RAM: CPU offload needs 16 B/param = 104 GiB of RAM, so the optimizer goes to NVMe.
    # Stage 2 then keeps the 14 GB of 16-bit params and one 1 GB gradient bucket on the GPU: it fits (with
    # a whole 16-bit gradient buffer, 28 GB, it would not), and stage 3 fits too.
    assert (rec["stage"], rec["offload_optimizer"], rec["offload_param"]) == (2, "nvme", "none")
    rows = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in out["rows"]}
    assert rows[(2, "nvme", "none")]["per_gpu_bytes"] == 7_000_000_000 * 2 + 500_000_000 * 2
    row = rows[(3, "nvme", "none")]
    # read and write master + states (12 B/param) once per step: 84 GB / 3 GB/s + 84 GB / 2 GB/s
    assert row["fit"]["nvme_io_seconds_per_step"] == pytest.approx(84e9 / 3e9 + 84e9 / 2e9)
    assert row["fit"]["fits"] is True
    stage0 = out["rows"][0]
    assert stage0["fit"]["fits"] is False and stage0["fit"]["gpu"] is False
    text = run(args)
    assert "Recommended (fits, least offload, so fastest): stage=2, offload_optimizer=nvme" in text
    assert "70.00 s" in text


def test_machine_profile_without_a_gpu_leaves_the_gpu_to_detection(tmp_path):
    # the NVMe bench writes gpu_bytes 0 and null bandwidths when it had no CUDA device / skipped a direction
    profile = write(
        tmp_path / "machine.json",
        '{"gpu_bytes": 0, "ram_bytes": 1024, "nvme_read_gbps": null, "nvme_write_gbps": null}',
    )
    out = json.loads(run(["--params", "1M", "--largest-layer", "1k", "--machine-profile", profile, "--json"]))
    assert "machine profile" not in out["machine"]["sources"].get("gpu_bytes", "")
    assert out["machine"]["ram_bytes"] == 1024
    # 1 KiB of RAM: every offloaded row fails on the host; the GPU is detected, not 0 bytes
    offloaded = [r for r in out["rows"] if r["offload_optimizer"] != "none" or r["offload_param"] != "none"]
    assert offloaded and all(r["fit"]["cpu"] is False for r in offloaded)
    if out["machine"]["gpu_bytes"] is None:  # no GPU here either: the device is the 1 KiB of host memory
        assert out["machine"]["cpu_only"] is True
        assert all(r["fit"]["cpu"] is False and r["fit"]["device"] == "cpu" for r in out["rows"])
        assert out["recommended"] is None


def test_fit_detects_this_machine(tmp_path):
    out = json.loads(
        run(["--params", "125M", "--largest-layer", "40M", "--fit", "--nvme-path", str(tmp_path), "--json"])
    )
    machine = out["machine"]
    assert machine["ram_bytes"] > 0 and machine["nvme_free_bytes"] > 0
    # small enough for any host; without CUDA the GPU stays unchecked rather than failing
    assert out["recommended"] is not None


def test_model_callable_is_counted_on_meta(tmp_path):
    factory = write(
        tmp_path / "tiny.py",
        """
        import torch

        def build():
            emb = torch.nn.Embedding(1000, 64)
            head = torch.nn.Linear(64, 1000, bias=False)
            head.weight = emb.weight
            assert emb.weight.device.type == "meta"
            return torch.nn.Sequential(emb, torch.nn.Linear(64, 64), head)
        """,
    )
    proc = cli("--model", f"{factory}:build", "--stage", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["params"] == 64000 + 64 * 64 + 64
    assert out["largest_layer_params"] == 64000


def test_wrapper_runs_from_another_directory(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "ds_estimate_memory.py"),
            "--params",
            "1B",
            "--stage",
            "0",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "18.63 GiB" in proc.stdout


def _bad_inputs(tmp_path):
    not_json = write(tmp_path / "not_json.json", "{stage: 3")
    bad_stage = write(tmp_path / "bad_stage.json", '{"zero_optimization": {"stage": 7}}')
    broken = write(tmp_path / "broken.py", "def build(:\n")
    profile = write(tmp_path / "profile.json", '{"ram_bytes": "lots"}')
    return {
        "negative size": (["--params", "-5"], "must be positive"),
        "non-numeric size": (["--params", "seven"], "cannot read 'seven'"),
        "unknown stage": (["--params", "7B", "--stage", "5"], "--stage"),
        "param offload below stage 3": (
            ["--params", "7B", "--stage", "1", "--offload-param", "cpu"],
            "stage 3",
        ),
        "config not JSON": (["--params", "7B", "--config", not_json], "not valid JSON"),
        "config bad value": (["--params", "7B", "--config", bad_stage], "zero_optimization.stage"),
        "config missing": (["--params", "7B", "--config", str(tmp_path / "nope.json")], "no such file"),
        "model does not import": (["--model", f"{broken}:build"], "cannot import"),
        "model module missing": (["--model", "no_such_module_xyz:build"], "no_such_module_xyz"),
        "no size": (["--stage", "3"], "--params"),
        "zero gpus": (["--params", "7B", "--gpus-per-node", "0"], "--gpus-per-node"),
        "largest layer too big": (["--params", "1B", "--largest-layer", "2B"], "exceeds"),
        "bad machine profile": (["--params", "1B", "--machine-profile", profile], "ram_bytes"),
        "unknown option": (["--params", "1B", "--frobnicate"], "frobnicate"),
    }


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    for name, (args, expected) in _bad_inputs(tmp_path).items():
        proc = cli(*args)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (name, proc.stderr)
        assert lines[0].startswith("ds-estimate-memory: error: "), (name, lines)
        assert expected in lines[0], (name, lines)
        assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_hf_config_without_transformers_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    config = write(tmp_path / "config.json", '{"model_type": "llama", "hidden_size": 64}')
    assert main(["--model", config]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install transformers" in err


def test_hf_config_is_counted_like_the_real_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    config = write(tmp_path / "config.json", json.dumps({"model_type": "gpt2", **shape}))
    proc = cli("--model", config, "--stage", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))
    # The LM head is tied to the token embedding: counted once.
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert out["largest_layer_params"] == max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
    )


def test_param_max_in_cpu_flag_moves_parameters_between_host_and_nvme(tmp_path):
    budget = write(tmp_path / "budget.json", json.dumps({"zero_offload": {"pinned_budget_bytes": 8 << 30}}))
    common = ["--params", "1B", "--largest-layer", "10M", "--stage", "3", "--offload-optimizer", "nvme"]
    common += ["--offload-param", "nvme", "--precision", "bf16", "--json", "--config", budget]
    rows = {}
    for flag in (None, "0", "250M"):
        proc = cli(*common, *(["--param-max-in-cpu", flag] if flag else []))
        assert proc.returncode == 0, proc.stderr
        rows[flag] = json.loads(proc.stdout)["rows"][0]
    # default "auto": the whole bf16 partition fits the 8 GiB budget; 0: all of it on NVMe; 250M: a quarter
    for flag, on_nvme in ((None, 0), ("0", 10**9), ("250M", 750 * 10**6)):
        parts = rows[flag]["breakdown"]
        assert parts["cpu"]["params_16bit"] == (10**9 - on_nvme) * 2
        assert parts["nvme"]["params_16bit"] == on_nvme * 2
        assert rows[flag]["nvme_min_bytes"] == rows[None]["nvme_min_bytes"] + on_nvme * 2
    # what leaves host memory is the partition, less the pinned read buffers NVMe parameters need
    staging = rows["0"]["breakdown"]["cpu"]["swap_buffers"] - rows[None]["breakdown"]["cpu"]["swap_buffers"]
    assert 0 < staging < 10**9
    assert rows["0"]["per_cpu_bytes"] == rows[None]["per_cpu_bytes"] - 2 * 10**9 + staging
    bad = cli(*common, "--param-max-in-cpu", "-1")
    assert bad.returncode != 0 and "--param-max-in-cpu" in bad.stderr


def test_param_max_in_cpu_defaults_to_the_engines_auto(tmp_path):
    """Without the flag, offload_param.max_in_cpu is the engine's default ("auto"): what fits in the pinned
    budget after the staging slots that stream the rest, not DeepSpeed's 1e9."""
    from offload.config.zero import OffloadParamConfig

    assert OffloadParamConfig.max_in_cpu == "auto"
    budget = 1 << 30
    cfg = write(tmp_path / "budget.json", json.dumps({"zero_offload": {"pinned_budget_bytes": budget}}))
    common = ["--params", "1B", "--largest-layer", "10M", "--stage", "3", "--offload-optimizer", "cpu"]
    common += ["--offload-param", "nvme", "--precision", "bf16", "--json", "--config", cfg]
    rows = {}
    for flag in (None, "auto"):
        proc = cli(*common, *(["--param-max-in-cpu", flag] if flag else []))
        assert proc.returncode == 0, proc.stderr
        rows[flag] = json.loads(proc.stdout)["rows"][0]
    assert rows[None] == rows["auto"]
    # 1 GiB holds 512Mi bf16 elements, less 5 staging slots (offload_param.buffer_count) of the 10M layer
    kept = (budget - 5 * 10_000_000 * 2) // 2
    parts = rows[None]["breakdown"]
    assert parts["cpu"]["params_16bit"] == kept * 2
    assert parts["nvme"]["params_16bit"] == (10**9 - kept) * 2
    assert any("max_in_cpu=auto" in n and "parameter elements" in n for n in rows[None]["notes"])


def test_config_sub_group_below_the_engines_minimum_is_rounded_up(tmp_path):
    """The estimator applies the engine's config rule: a sub_group_size below the minimum is the minimum."""
    from offload.config import MIN_SUB_GROUP_SIZE
    from offload.estimate.ds_config import read_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": MIN_SUB_GROUP_SIZE - 1}}))
    assert read_ds_config(str(path)).buffers["sub_group_size"] == MIN_SUB_GROUP_SIZE
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": MIN_SUB_GROUP_SIZE}}))
    assert read_ds_config(str(path)).buffers["sub_group_size"] == MIN_SUB_GROUP_SIZE


def test_config_aio_queue_depth_sizes_the_write_back_buffers(tmp_path):
    """The config's aio.queue_depth reaches the estimate (the writes in flight hold their buffers); a bad
    value is refused naming the key."""
    from offload.estimate import EstimateInputError
    from offload.estimate.ds_config import read_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "aio": {"queue_depth": 3}}))
    assert read_ds_config(str(path)).buffers["aio_queue_depth"] == 3
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "aio": {"queue_depth": 0}}))
    with pytest.raises(EstimateInputError, match="aio.queue_depth"):
        read_ds_config(str(path))


def test_model_module_is_not_looked_up_in_the_current_directory(tmp_path):
    """`--model mod:fn` imports `mod` from sys.path as it is: the current directory is not put first (a
    file there would shadow any module imported after it). Python run with -P adds nothing for -m either;
    a file in the current directory is named by its path."""
    write(
        tmp_path / "cwd_model_xyz.py",
        """
        import torch

        def build():
            return torch.nn.Linear(4, 4)
        """,
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = ["-m", "offload.cli.estimate_memory", "--stage", "0", "--json", "--model"]
    proc = subprocess.run(
        [sys.executable, "-P", *args, "cwd_model_xyz:build"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stdout
    assert "cannot import cwd_model_xyz: ModuleNotFoundError" in proc.stderr
    for model, path in (("./cwd_model_xyz.py:build", ROOT), ("cwd_model_xyz:build", f"{ROOT}:{tmp_path}")):
        proc = subprocess.run(
            [sys.executable, "-P", *args, model], cwd=tmp_path, capture_output=True, text=True,
            env={**env, "PYTHONPATH": path},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["params"] == 20
