"""One contender of benchmarks/bench_gpu.py training: plain torch or the engine on a ladder shape
(Trainer), and the child-process jobs that time its steps (child_train, child_interleaved)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List

from benchmarks.gpu_ladder import CONFIGS, Shape, engine_config, fmt_params
from benchmarks.harness import interleave


# ------------------------------------------------------------------------------------------- training
def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


class Trainer:
    """One contender: plain torch or the engine, a step = `accum` micro-batches then the update."""

    def __init__(
        self,
        name: str,
        shape: Shape,
        s: argparse.Namespace,
        seq: int,
        micro: int,
        accum: int,
        ckpt: bool,
        nvme_dir: str,
        ratio: float = 1.0,
    ) -> None:
        import torch
        import transformers

        import zero

        self.name, self.shape, self.seq, self.micro, self.accum = name, shape, seq, micro, accum
        self.vocab = shape.vocab
        self.device = torch.device(s.device)
        self.step_index = 0
        hf = shape.hf_config(seq)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        conf = None if CONFIGS[name] is None else engine_config(name, s, nvme_dir, micro, accum, shape, ratio)
        if conf is not None and CONFIGS[name][0] == 3:  # type: ignore[index]
            from offload.config import load_config

            load_config(conf)  # a refused key fails here, before the model is built
            with zero.Init(config_dict_or_path=conf):
                model = transformers.LlamaForCausalLM(hf)
        else:
            dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with self.device:
                    model = transformers.LlamaForCausalLM(hf)
            finally:
                torch.set_default_dtype(dtype)
        if ckpt:
            enable = (
                getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            )
            enable({"use_reentrant": False})  # torch's checkpoint, in place, for every contender alike
        model.train()
        self.build_s = time.perf_counter() - t0
        if conf is None:
            self.model = model
            fused = self.device.type == "cuda"
            self.opt = torch.optim.AdamW(
                model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused
            )
            self.engine = None
        else:
            self.engine, *_ = zero.initialize(model=model, config=conf)
        self.sync()
        self.init_s = time.perf_counter() - t0

    def sync(self) -> None:
        """Wait for the device's queued work."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def batch(self, i: int) -> Any:
        """Micro-batch i of token ids (seeded by i: every contender sees the same batches)."""
        import torch

        g = torch.Generator().manual_seed(1_000_003 + i)
        return torch.randint(0, self.vocab, (self.micro, self.seq), generator=g).to(self.device)

    def step(self) -> Dict[str, float]:
        """One optimizer step (all its micro-batches), finished on the device; the loss and report."""
        losses = []
        for _ in range(self.accum):
            ids = self.batch(self.step_index)
            self.step_index += 1
            if self.engine is None:
                loss = self.model(input_ids=ids, labels=ids).loss
                (loss / self.accum).backward()
            else:
                loss = self.engine(input_ids=ids, labels=ids).loss
                self.engine.backward(loss)
                self.engine.step()
            losses.append(loss.detach())
        if self.engine is None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.sync()
        out = {"loss": float(sum(x.float() for x in losses).item() / len(losses))}
        rep = None if self.engine is None else self.engine.last_report
        if rep is not None:
            out.update(forward_s=rep.forward_s, backward_s=rep.backward_s, optimizer_s=rep.optimizer_s)
            # this engine's pinned bytes (rep.pinned_bytes_in_use is the process's: every contender's), and
            # the delayed update's host step and the part of it hidden behind forward and backward
            out.update(pinned_bytes=self.engine.pinned_bytes, host_step_s=rep.host_step_s)
            out.update(host_step_hidden_s=rep.host_step_hidden_s)
        return out

    def close(self) -> None:
        """Close the engine (swap files, pinned memory)."""
        if self.engine is not None:
            self.engine.close()


def flops_per_step(params: int, tokens: int, ckpt: bool) -> float:
    """Model FLOPs of one step: 6 P T (forward and backward), plus 2 P T for checkpointing's recompute."""
    return (8 if ckpt else 6) * params * tokens


def child_train(args: argparse.Namespace, job: Dict[str, Any]) -> Dict[str, Any]:
    """Build one contender and run job["steps"] steps (the first job["warmup"] untimed)."""
    import torch

    shape = Shape(**job["shape"])
    out: Dict[str, Any] = {"name": job["name"], "params": shape.params, "shape": job["shape"]}
    trainer = None
    try:
        trainer = Trainer(
            job["name"], shape, args, job["seq"], job["micro"], job["accum"], job["ckpt"], job["nvme_dir"]
        )
        print(
            f"  [{job['name']}] {fmt_params(shape.params)} built and initialised in {trainer.init_s:.1f} s",
            flush=True,
        )
        rows = []
        for i in range(job["warmup"] + job["steps"]):
            t0 = time.perf_counter()
            row = trainer.step()
            row["step_s"] = time.perf_counter() - t0
            print(
                f"  [{job['name']}] step {i + 1}: {row['step_s']:.2f} s, loss {row['loss']:.4f}", flush=True
            )
            if i >= job["warmup"]:
                rows.append(row)
        out.update(status="ok", rows=rows, init_s=trainer.init_s, build_s=trainer.build_s)
    except Exception as exc:  # noqa: BLE001 - every failure is a result of this try
        from offload.config import ConfigError

        kind = "refused" if isinstance(exc, ConfigError) else "oom" if _is_oom(exc) else "error"
        out.update(status=kind, error=f"{type(exc).__name__}: {str(exc)[:500]}")
        print(f"  [{job['name']}] {kind}: {out['error'][:200]}", flush=True)
    finally:
        if trainer is not None:
            trainer.close()
    if args.device == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return out


def child_interleaved(args: argparse.Namespace, job: Dict[str, Any]) -> Dict[str, Any]:
    """Several contenders in this process, steps alternating (A B A B ...); refused ones reported."""
    from offload.config import ConfigError

    shape = Shape(**job["shape"])
    trainers: Dict[str, Trainer] = {}
    result: Dict[str, Any] = {"params": shape.params, "shape": job["shape"], "contenders": {}}
    for label, (name, ratio) in job["contenders"].items():
        try:
            trainers[label] = Trainer(
                name, shape, args, job["seq"], job["micro"], job["accum"], job["ckpt"], job["nvme_dir"], ratio
            )
            print(f"  [{label}] initialised in {trainers[label].init_s:.1f} s", flush=True)
        except ConfigError as exc:
            result["contenders"][label] = {"status": "refused", "error": str(exc)[:500]}
            print(f"  [{label}] refused by the engine: {exc}", flush=True)
    losses: Dict[str, List[float]] = {label: [] for label in trainers}

    def runner(label: str) -> Callable[[], Dict[str, float]]:
        def run() -> Dict[str, float]:
            row = trainers[label].step()
            losses[label].append(row.pop("loss"))
            return row

        return run

    if trainers:
        res = interleave({label: runner(label) for label in trainers}, job["repeats"], warmup=job["warmup"])
        for label, r in res.items():
            result["contenders"][label] = {
                "status": "ok",
                "step_s": r.median,
                "step_min_s": r.minimum,
                "step_max_s": r.maximum,
                "samples": r.samples,
                "report": r.extra,
                "losses": losses[label],
            }
    for t in trainers.values():
        t.close()
    return result
