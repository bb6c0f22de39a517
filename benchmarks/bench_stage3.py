"""Stage 3 through the engine vs plain torch on a small GPT (CPU): one training step (forward, backward,
optimizer) per parameter / optimizer tier, A B A B interleaved, medians.

    .venv/bin/python -m benchmarks.bench_stage3 [--params 20e6] [--repeats 5]

Contenders: plain torch AdamW; the engine at stage 2 with the optimizer on cpu (the stage 0-2 path); the
engine at stage 3 with parameters / optimizer on none/none, cpu/cpu, nvme/nvme. Also printed for the nvme
run: parameter bytes read / written per step and how many reads the prefetcher served. Numbers are noisy
on a shared 2-core machine: read them as ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import torch

import zero
from benchmarks.harness import interleave, markdown_table, write_outputs
from zero.examples.models import GPT, config_for_params, corpus_bytes, get_batch

BATCH = 4


def engine_config(stage: int, param: str, optim: str, nvme: str, sub_group: int) -> Dict[str, Any]:
    """A DeepSpeed config for `stage` with the given parameter and optimizer tiers."""
    zo: Dict[str, Any] = {"stage": stage, "sub_group_size": sub_group}
    if optim != "none":
        zo["offload_optimizer"] = {"device": optim, "nvme_path": nvme, "buffer_count": 4, "max_in_cpu": 0}
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
        if param != "none":
            zo["offload_param"] = {"device": param, "nvme_path": nvme, "max_in_cpu": 0, "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zo,
    }


def main(argv: Optional[List[str]] = None) -> None:
    """Command line: time the stage-3 placements of a GPT of --params parameters and write a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = config_for_params(int(args.params), seq_len=128)
    base = GPT(cfg)
    n = sum(p.numel() for p in base.parameters())
    data = corpus_bytes()
    batches = [get_batch(data, BATCH, cfg.seq_len, i) for i in range(4)]
    tmp = tempfile.mkdtemp(prefix="bench-stage3-")
    counter = {"i": 0}

    def next_batch() -> Any:
        counter["i"] += 1
        return batches[counter["i"] % len(batches)]

    contenders: Dict[str, Any] = {}
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01)

    def torch_step() -> None:
        x, y = next_batch()
        ref(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    contenders["torch AdamW"] = torch_step
    engines = {}
    sub_group = max(1 << 16, n // 6)
    for name, stage, param, optim in (
        ("stage2 optim=cpu", 2, "none", "cpu"),
        ("stage3 none/none", 3, "none", "none"),
        ("stage3 cpu/cpu", 3, "cpu", "cpu"),
        ("stage3 nvme/nvme", 3, "nvme", "nvme"),
    ):
        eng, *_ = zero.initialize(
            model=copy.deepcopy(base), config=engine_config(stage, param, optim, tmp, sub_group)
        )
        engines[name] = eng

        def step(eng: Any = eng) -> Dict[str, float]:
            x, y = next_batch()
            eng.backward(eng(x, y))
            eng.step()
            extra = {"optimizer_nvme_bytes": float(eng.last_report.nvme_read_bytes)}
            pio = getattr(eng, "last_param_io", None)
            if pio:
                extra["param_nvme_read_bytes"] = float(pio["param_nvme_read_bytes"])
                extra["param_nvme_write_bytes"] = float(pio["param_nvme_write_bytes"])
                extra["prefetch_hits"] = float(pio["param_prefetch_hits"])
                extra["param_reads"] = float(pio["param_reads"])
            return extra

        contenders[name] = step
    try:
        res = interleave(contenders, repeats=args.repeats, warmup=1)
    finally:
        for eng in engines.values():
            eng.close()
        shutil.rmtree(tmp, ignore_errors=True)
    torch_ms = res["torch AdamW"].median * 1e3
    rows = []
    for k, r in res.items():
        ex = r.extra or {}
        rows.append(
            [
                k,
                f"{r.median * 1e3:.0f}",
                f"{r.median * 1e3 / torch_ms:.2f}",
                f"{ex.get('param_nvme_read_bytes', 0) / 1e6:.1f}",
                f"{ex.get('param_nvme_write_bytes', 0) / 1e6:.1f}",
                f"{ex.get('prefetch_hits', 0):.0f}/{ex.get('param_reads', 0):.0f}",
                f"{ex.get('optimizer_nvme_bytes', 0) / 1e6:.1f}",
            ]
        )
    header = f"GPT {n / 1e6:.1f}M params (d_model {cfg.d_model}, {cfg.n_layer} layers), "
    header += f"batch {BATCH}x{cfg.seq_len}, median of {args.repeats} interleaved steps, fp32, CPU\n\n"
    table = markdown_table(
        [
            "contender",
            "step ms",
            "x torch",
            "param MB read",
            "param MB written",
            "prefetch hits/reads",
            "optim MB read",
        ],
        rows,
    )
    payload = {
        "params": n,
        "results": {k: {"median_s": r.median, "extra": r.extra} for k, r in res.items()},
    }
    write_outputs("bench_stage3", payload, header + table)


if __name__ == "__main__":
    main()
