"""One configuration of benchmarks/bench_e2e.py, ours or plain torch, measured in this process: the child
`python -m benchmarks.bench_e2e --worker SPEC OUT` runs (DeepSpeed's: benchmarks/deepspeed_runner.py)."""

from __future__ import annotations

import time
from typing import Any, Dict

from benchmarks.e2e_configs import LR, WEIGHT_DECAY


# ------------------------------------------------------------------------------------------- workers
def run_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run one configuration of ours or plain torch in this process (spec["engine"])."""
    import torch

    from benchmarks.deepspeed_runner import (
        batch,
        device_sync,
        make_model,
        measure,
        peak_rss_bytes,
        rss_bytes,
    )

    device = spec.get("device", "cpu")
    sync = device_sync(spec)
    if device == "cuda":
        torch.cuda.init()  # CUDA's context is set-up cost of the process, not of the model's initialisation
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    model = make_model(spec)
    build_s = time.perf_counter() - t0
    if spec["engine"] == "torch":
        bf16 = spec["dtype"] == "bf16"
        model.to(device)
        # fused: one kernel over all parameters, on the CPU or the GPU alike
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        sync()
        init_s = time.perf_counter() - t0
        init_peak = peak_rss_bytes()

        def forward(i: int) -> torch.Tensor:
            x, y = batch(spec, i, torch.device(device))
            # bf16 baseline: autocast over fp32 weights (the mixed-precision recipe the engines implement)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                return model(x, y)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        out = measure(spec, forward, backward, step)
    else:
        import zero
        from offload.config import ConfigError

        try:
            engine, *_ = zero.initialize(model=model, config=spec["config"])
        except ConfigError as exc:  # a key this engine does not take (yet): a result, not a failure
            return {"refused": str(exc)}
        if engine.device.type != device:  # the accelerator comes from the environment _run sets
            raise RuntimeError(f"the engine computes on {engine.device}, this run asked for {device}")
        sync()
        init_s = time.perf_counter() - t0
        init_peak = peak_rss_bytes()

        def forward(i: int) -> torch.Tensor:
            x, y = batch(spec, i, engine.device)  # the caller's job, as with DeepSpeed
            return engine(x, y)

        def extra() -> Dict[str, float]:
            rep = engine.last_report
            return {
                "io_wait_s": rep.io_wait_s,
                "optimizer_compute_s": rep.optimizer_compute_s,
                "engine_optimizer_s": rep.optimizer_s,
                "engine_backward_s": rep.backward_s,
                "nvme_read_bytes": float(rep.nvme_read_bytes),
                "nvme_write_bytes": float(rep.nvme_write_bytes),
                # stage 3: the parameter partitions' swap files (zero for the other stages)
                "param_nvme_read_bytes": float((engine.last_param_io or {}).get("param_nvme_read_bytes", 0)),
                "param_nvme_write_bytes": float(
                    (engine.last_param_io or {}).get("param_nvme_write_bytes", 0)
                ),
            }

        out = measure(spec, forward, engine.backward, engine.step, extra)
        out["pinned_bytes"] = engine.pinned_bytes
        engine.close()
    out.update(init_s=init_s, build_s=build_s, init_peak_rss_bytes=init_peak, rss_before_init_bytes=rss0)
    out["peak_rss_bytes"] = max(init_peak, out["steady_peak_rss_bytes"])
    return out
