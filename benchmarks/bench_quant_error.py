"""Error of ZeRO-Inference weight quantization (`weight_quantization`) against the unquantized model.

    .venv/bin/python -m benchmarks.bench_quant_error [--seeds 5] [--big] [--models M ...] [--settings S ...]

For each model (random weights, built from a config: tiny GPT-2 and tiny Llama - the configs of
tests/test_inference_quant.py - and with --big a Llama of hidden size 512, 4 layers, vocab 4096) and each
setting (int8 / int4, asymmetric / symmetric, group 64; int8 / int4 with `zero_offload.int8_activations`,
which applies to Linears with rows of whole groups: the Llamas', not GPT-2's Conv1D), over `--seeds` model
seeds: the inference engine at stage 3 (cpu tier) runs fixed prompts (2 x 6 tokens, seed 1, the tests'
prompt) and

* `max_rel_logit_err`: max |logits_q - logits| / max |logits| over the batch, the worst seed;
* `token_agreement`: the share of 8 greedy tokens equal to the unquantized model's, the worst seed;
* `bytes_ratio`: the partitions' bytes in fp32 over their stored bytes (the bytes a forward reads).

Writes benchmarks/out/bench_quant_error.{json,md}. Error, not speed: nothing here is timed.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Dict, List

import torch
import transformers

import zero
from benchmarks.harness import markdown_table, write_outputs

VOCAB = 128
SETTINGS = [
    ("int8", {"num_bits": 8}),
    ("int8 sym", {"num_bits": 8, "symmetric": True}),
    ("int4", {"num_bits": 4}),
    ("int4 sym", {"num_bits": 4, "symmetric": True}),
    # zero_offload.int8_activations as well: Linears with rows of whole groups multiply int8 activations
    ("int8 + int8 act", {"num_bits": 8, "int8_activations": True}),
    ("int4 + int8 act", {"num_bits": 4, "int8_activations": True}),
]


def gpt2_tiny() -> Any:
    """A two-layer GPT-2 with hidden size 64."""
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama_tiny() -> Any:
    """A two-layer Llama with hidden size 64 (untied embeddings)."""
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False,
        )
    )  # fmt: skip


def llama_big() -> Any:
    """A four-layer Llama with hidden size 512."""
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
            eos_token_id=2,
        )
    )  # fmt: skip


def prompts(vocab: int) -> torch.Tensor:
    """Two fixed random prompts of six tokens."""
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))


def greedy(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Eight greedily generated tokens after `ids`."""
    mask = torch.ones_like(ids)
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)


def measure(build: Any, setting: Dict[str, Any], seed: int) -> Dict[str, float]:
    """Logit error, greedy-token agreement and byte ratio of `build()` quantized with `setting`."""
    torch.manual_seed(seed)
    model = build().eval()
    ids = prompts(model.config.vocab_size)
    with torch.no_grad():
        want = model(ids).logits
        want_tokens = greedy(model, ids)
    spec = {k: v for k, v in setting.items() if k != "int8_activations"}
    cfg: Dict[str, Any] = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "weight_quantization": {"quantized_initialization": spec},
    }
    if setting.get("int8_activations"):
        cfg["zero_offload"] = {"int8_activations": True}
    engine, *_ = zero.initialize(model=copy.deepcopy(model), config=cfg)
    with torch.no_grad():
        got = engine(ids).logits
    tokens = greedy(engine.module, ids)
    q = engine.layout.quantization()
    engine.close()
    new = slice(ids.shape[1], None)
    return {
        "max_rel_logit_err": float((got - want).abs().max() / want.abs().max()),
        "token_agreement": float((tokens[:, new] == want_tokens[:, new]).float().mean()),
        "bytes_ratio": q["unquantized_bytes"] / q["stored_bytes"],
    }


def main() -> None:
    """Command line: the quantization error table over models, settings and seeds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--big", action="store_true", help="also the Llama of hidden size 512 (slower)")
    ap.add_argument("--models", nargs="*", help="only these models (gpt2-tiny, llama-tiny, llama-h512)")
    ap.add_argument("--settings", nargs="*", help="only these settings ('int8', 'int4 sym', ...)")
    args = ap.parse_args()
    models = {"gpt2-tiny": gpt2_tiny, "llama-tiny": llama_tiny}
    if args.big:
        models["llama-h512"] = llama_big
    results: List[Dict[str, Any]] = []
    for mname, build in models.items():
        if args.models and mname not in args.models:
            continue
        for sname, setting in SETTINGS:
            if args.settings and sname not in args.settings:
                continue
            if setting.get("int8_activations") and mname.startswith("gpt2"):
                continue  # GPT-2's Conv1D modules never compute from their codes: nothing would change
            runs = [measure(build, setting, seed) for seed in range(args.seeds)]
            results.append(
                {
                    "model": mname,
                    "setting": sname,
                    "group_size": 64,
                    "seeds": args.seeds,
                    "max_rel_logit_err": max(r["max_rel_logit_err"] for r in runs),
                    "median_rel_logit_err": sorted(r["max_rel_logit_err"] for r in runs)[len(runs) // 2],
                    "min_token_agreement": min(r["token_agreement"] for r in runs),
                    "bytes_ratio": runs[0]["bytes_ratio"],
                }
            )
            print(results[-1], flush=True)
    rows = [
        [
            r["model"],
            r["setting"],
            r["median_rel_logit_err"],
            r["max_rel_logit_err"],
            r["min_token_agreement"],
            r["bytes_ratio"],
        ]
        for r in results
    ]
    table = markdown_table(
        [
            "model",
            "setting (group 64)",
            "rel. logit error, median seed",
            "worst seed",
            "greedy tokens equal, worst seed",
            "fp32 bytes / stored",
        ],
        rows,
    )
    write_outputs("bench_quant_error", {"results": results}, table)


if __name__ == "__main__":
    main()
