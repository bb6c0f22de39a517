"""zero.integrations.transformers: transformers' Trainer through zero-offload (`ZeroTrainer`).

A tiny GPT-2 (random initialisation, dropout on) fine-tuned on an in-memory set of token ids: the training
losses, gradient norms and learning rates against the plain Trainer with torch AdamW (same seed), at stage 2
with the optimizer on the CPU and at stage 3 with parameters and optimizer on NVMe; gradient accumulation
divided once on both of the Trainer's loss paths; the config's optimizer and scheduler blocks; checkpoint-N
folders with the engine's global_stepN checkpoint and a bit-exact resume; save_model's Hugging Face
checkpoint; load_best_model_at_end; the "auto" filling of every key and the contradiction error; stage-3
models never whole in memory - streamed from a checkpoint into partitions (`from_pretrained`), or built
under zero.Init - taken over by the trainer's engine and trained.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from zero.integrations.transformers import (  # noqa: E402
    ZeroTrainer,
    fill_zero_config,
    from_pretrained,
    hidden_size_of,
)

HIDDEN = 32
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: faster for a model this small, and a second thread's waits on a loaded shared
    machine made each backward ~20 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)


def token_ids(n: int = 16, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def training_args(out, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-3,
        max_grad_norm=1.0,  # clips: the norms are ~1.3
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


def zero_config(stage: int, tmp_path, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }
    z = cfg["zero_optimization"]
    if stage == 3:
        nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
        # max_in_cpu 0: every partition in its swap file (by default the first 1e9 elements stay in memory)
        z.update(
            offload_param={**nvme, "max_in_cpu": 0},
            offload_optimizer=nvme,
            stage3_prefetch_bucket_size="auto",
        )
        z.update(stage3_param_persistence_threshold="auto", stage3_gather_16bit_weights_on_model_save=True)
    else:
        z["offload_optimizer"] = {"device": "cpu"}
    cfg.update(extra)
    return cfg


STAGES = [pytest.param(2, id="stage2-cpu"), pytest.param(3, id="stage3-nvme")]


def logged(trainer):
    """(step, loss, grad_norm, learning_rate) of every logged training step."""
    return [
        (h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
        for h in trainer.state.log_history
        if "loss" in h
    ]


def assert_same_run(got, want, exact=False):
    assert [s for s, *_ in got] == [s for s, *_ in want] and got
    for (_, loss, norm, lr), (_, loss0, norm0, lr0) in zip(got, want):
        if exact:
            assert (loss, norm, lr) == (loss0, norm0, lr0)
        else:
            assert abs(loss - loss0) <= TOL and abs(norm - norm0) <= TOL * norm0 and lr == pytest.approx(lr0)


def plain_run(tmp_path, model=None, **kw):
    trainer = Trainer(
        model=model or tiny_gpt2(), args=training_args(tmp_path / "plain", **kw), train_dataset=token_ids()
    )
    trainer.train()
    return trainer


def zero_run(tmp_path, cfg, model=None, resume=None, out="zero", **kw):
    args = training_args(tmp_path / out, **kw)
    trainer = ZeroTrainer(model=model or tiny_gpt2(), args=args, train_dataset=token_ids(), zero_config=cfg)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_importing_the_module_does_not_import_transformers():
    code = "import sys, zero.integrations.transformers as m; assert 'transformers' not in sys.modules, m"
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.dirname(__file__)),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


# ------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("stage", STAGES)
def test_losses_match_the_plain_trainer(stage, tmp_path):
    want = logged(plain_run(tmp_path))
    trainer = zero_run(tmp_path, zero_config(stage, tmp_path))
    assert_same_run(logged(trainer), want)
    engine = trainer.engine
    assert engine.stage == stage and engine.global_steps == 6 and engine.gradient_accumulation_steps() == 2
    assert engine.offload_device == ("nvme" if stage == 3 else "cpu")
    if stage == 3:
        assert engine.partitioner.store.tier == "nvme"
    filled = trainer.zero_config
    keys = (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
    )
    assert [filled[k] for k in keys] == [2, 2, 4, 1.0]
    assert filled["zero_optimization"]["reduce_bucket_size"] == HIDDEN * HIDDEN


def test_weight_decay_without_an_optimizer_block_keeps_the_trainers_two_groups(tmp_path):
    """The Trainer's AdamW decays weights but not biases and LayerNorm weights (two param groups): the
    engine takes both groups, and the run follows the plain Trainer's."""
    want = logged(plain_run(tmp_path, weight_decay=0.5))
    trainer = zero_run(tmp_path, zero_config(2, tmp_path), weight_decay=0.5)
    assert_same_run(logged(trainer), want)
    groups = trainer.engine.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    names = {id(p): n for n, p in trainer.engine.module.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert no_decay == set(names.values()) - set(trainer.get_decay_parameter_names(trainer.engine.module))
    assert any(n.endswith(".bias") for n in no_decay) and any(".ln_" in n for n in no_decay)


def test_accumulation_is_divided_once_when_the_trainer_divides_the_loss(tmp_path):
    """Without num_items_in_batch (a model without loss kwargs) the Trainer divides each micro-batch's loss
    by the window size; the engine must not divide again. Without clipping the logged gradient norm (and,
    with Adam's eps, the losses) would show a second division."""

    def run(cls, out, **kw):
        args = training_args(tmp_path / out, max_grad_norm=0.0)
        trainer = cls(model=tiny_gpt2(), args=args, train_dataset=token_ids(), **kw)
        trainer.model_accepts_loss_kwargs = False  # the Trainer's other loss path
        trainer.train()
        return logged(trainer)

    want = run(Trainer, "plain")
    assert_same_run(run(ZeroTrainer, "zero", zero_config=zero_config(2, tmp_path)), want)


def test_config_optimizer_and_scheduler_blocks_with_auto_values(tmp_path):
    """An optimizer block replaces the Trainer's AdamW (same run: weight decay 0); a scheduler block the
    Trainer's schedule, with DeepSpeed's counting (the first step runs at iteration -1)."""
    auto = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
    cfg = zero_config(2, tmp_path, optimizer={"type": "AdamW", "params": auto})
    trainer = zero_run(tmp_path, cfg)
    assert_same_run(logged(trainer), logged(plain_run(tmp_path)))
    assert trainer.zero_config["optimizer"]["params"] == {
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    sched = {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {**sched, "warmup_type": "linear"}}
    trainer = zero_run(
        tmp_path, cfg, out="zero-sched", warmup_steps=0.25
    )  # a ratio: ceil(0.25 * 6) = 2 steps
    assert trainer.zero_config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 2,
        "total_num_steps": 6,
        "warmup_type": "linear",
    }
    assert [lr for *_, lr in logged(trainer)] == pytest.approx([0, 0, 5e-4, 1e-3, 7.5e-4, 5e-4])


# ---------------------------------------------------------------------------------------- checkpoints
def optimizer_state(engine):
    sd = engine.optimizer_state_dict()
    return [sd["master"], *sd["states"]], sd["step"]


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoints_and_a_bit_exact_resume(stage, tmp_path):
    cfg = zero_config(stage, tmp_path)
    whole = zero_run(tmp_path, cfg, out="whole", save_strategy="steps", save_steps=3)
    ckpt = tmp_path / "whole" / "checkpoint-3"
    files = set(os.listdir(ckpt))
    assert {"global_step3", "latest", "trainer_state.json", "rng_state.pth", "config.json"} <= files
    assert "model.safetensors" in files  # the Trainer's own weights file, consolidated (stage 3: gathered)
    assert (ckpt / "latest").read_text().strip() == "global_step3"
    assert "manifest.json" in os.listdir(ckpt / "global_step3")
    assert not {"optimizer.pt", "scheduler.pt"} & files  # the engine's checkpoint holds them

    # another initialisation: everything must come from the checkpoint
    resumed = zero_run(
        tmp_path,
        cfg,
        model=tiny_gpt2(seed=7),
        resume=str(ckpt),
        out="resumed",
        save_strategy="steps",
        save_steps=3,
    )
    assert_same_run(logged(resumed)[3:], logged(whole)[3:], exact=True)  # steps 4-6: losses, norms, lrs
    a, b = whole.engine, resumed.engine
    assert a.global_steps == b.global_steps == 6
    for (name, x), y in zip(a.consolidated_state_dict().items(), b.consolidated_state_dict().values()):
        assert torch.equal(x, y), name
    (sa, na), (sb, nb) = optimizer_state(a), optimizer_state(b)
    assert na == nb == 6 and all(torch.equal(x, y) for x, y in zip(sa, sb))
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()


def test_resume_needs_an_engine_checkpoint(tmp_path):
    plain = plain_run(tmp_path, save_strategy="steps", save_steps=3)
    with pytest.raises(ValueError, match="no engine checkpoint"):
        zero_run(tmp_path, zero_config(2, tmp_path), resume=str(tmp_path / "plain" / "checkpoint-3"))
    assert plain.state.global_step == 6


@pytest.mark.parametrize("stage", STAGES)
def test_save_model_writes_a_hugging_face_checkpoint(stage, tmp_path):
    trainer = zero_run(tmp_path, zero_config(stage, tmp_path))
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    weights = trainer.engine.consolidated_state_dict()
    got = loaded.state_dict()
    assert set(weights) <= set(got)
    for name, value in weights.items():
        assert torch.equal(got[name], value), name
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    trainer.engine.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trainer.engine(input_ids=ids).logits)


def test_bf16_from_the_arguments(tmp_path):
    """bf16=True in the arguments: the engine computes in bf16 (fp32 master), save_model writes bf16."""
    trainer = zero_run(tmp_path, zero_config(2, tmp_path, bf16={"enabled": "auto"}), bf16=True)
    assert trainer.zero_config["bf16"] == {"enabled": True} and trainer.engine.dtype == torch.bfloat16
    for (_, loss, *_), (_, want, *_) in zip(logged(trainer), logged(plain_run(tmp_path))):
        assert abs(loss - want) < 1e-3  # bf16 rounding of the weights and activations
    trainer.save_model(str(tmp_path / "final"))
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")).dtype == torch.bfloat16


def test_stage3_save_model_without_gathering_saves_the_engine_checkpoint(tmp_path, caplog):
    cfg = zero_config(3, tmp_path)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    trainer = zero_run(tmp_path, cfg)
    with caplog.at_level(logging.WARNING, logger="zero"):
        trainer.save_model(str(tmp_path / "final"))
    files = set(os.listdir(tmp_path / "final"))
    assert {"config.json", "global_step6", "latest"} <= files and "model.safetensors" not in files
    assert "stage3_gather_16bit_weights_on_model_save is false" in caplog.text


# ------------------------------------------------------------------------------------------ the config
ALL_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
        },
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def test_fill_zero_config_fills_every_auto_key(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
        learning_rate=2e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.01,
        warmup_steps=0.1,  # a ratio of the steps
        max_steps=50,
        bf16=True,
        use_cpu=True,
        report_to=[],
    )
    cfg = fill_zero_config(ALL_AUTO, args, tiny_gpt2())
    assert ALL_AUTO["train_batch_size"] == "auto"  # the input is left as it was
    (tmp_path / "ds.json").write_text(json.dumps(ALL_AUTO))
    assert fill_zero_config(str(tmp_path / "ds.json"), args, tiny_gpt2()) == cfg  # a JSON path too
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (3, 4)
    assert (cfg["train_batch_size"], cfg["gradient_clipping"]) == (12, 0.5)
    assert cfg["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.01}
    assert cfg["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 2e-4,
        "warmup_num_steps": 5,
        "total_num_steps": 50,
    }
    assert (cfg["bf16"]["enabled"], cfg["fp16"]["enabled"]) == (True, False)
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == HIDDEN**2 and z["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN**2)
    assert z["stage3_param_persistence_threshold"] == 10 * HIDDEN

    # the steps the Trainer computed win over max_steps; no warmup -> 1 step (the schedulers need >= 1)
    args.bf16, args.fp16, args.warmup_steps = False, True, 0
    cfg = fill_zero_config(ALL_AUTO, args, tiny_gpt2(), num_training_steps=80)
    assert (cfg["bf16"]["enabled"], cfg["fp16"]["enabled"]) == (False, True)
    assert (
        cfg["scheduler"]["params"]["total_num_steps"] == 80
        and cfg["scheduler"]["params"]["warmup_num_steps"] == 1
    )

    # keys the arguments define and the config leaves out are taken from them; others stay out
    cfg = fill_zero_config({"zero_optimization": {"stage": 2}}, args)
    assert cfg == {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True},
    }


def test_hidden_size_from_the_model_or_its_config():
    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert hidden_size_of(tiny_gpt2()) == HIDDEN  # GPT-2: n_embd (hidden_size aliases it)
    assert hidden_size_of(Cfg(d_model=48)) == 48
    assert hidden_size_of(Cfg(hidden_sizes=[16, 64, 32])) == 64
    assert hidden_size_of(Cfg(text_config=Cfg(hidden_size=24))) == 24
    assert hidden_size_of(torch.nn.Linear(2, 2)) is None
    with pytest.raises(
        ValueError, match="reduce_bucket_size in zero_config: .auto. needs the model.s hidden size"
    ):
        fill_zero_config(
            {"zero_optimization": {"reduce_bucket_size": "auto"}},
            training_args("/tmp/x"),
            torch.nn.Linear(2, 2),
        )


def test_a_value_contradicting_the_arguments_is_an_error_naming_both(tmp_path):
    cfg = zero_config(2, tmp_path, gradient_accumulation_steps=4, bf16={"enabled": True})
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.999]}}
    with pytest.raises(ValueError) as err:
        fill_zero_config(cfg, training_args(tmp_path))
    msg = str(err.value)
    assert (
        "gradient_accumulation_steps=4 in zero_config vs gradient_accumulation_steps=2 in TrainingArguments"
        in msg
    )
    assert "optimizer.params.lr=0.0005 in zero_config vs learning_rate=0.001 in TrainingArguments" in msg
    assert (
        "bf16.enabled=True in zero_config vs bf16=False" in msg and "betas" not in msg
    )  # (0.9, 0.999) agrees
    trainer = ZeroTrainer(
        model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=token_ids(), zero_config=cfg
    )
    with pytest.raises(ValueError, match="contradict the TrainingArguments"):
        trainer.train()  # the engine is built (and the config filled) when training starts


def test_refused_combinations(tmp_path):
    def make(cfg=None, **kw):
        args = training_args(tmp_path, **kw)
        ZeroTrainer(
            model=tiny_gpt2(),
            args=args,
            train_dataset=token_ids(),
            zero_config=cfg or zero_config(2, tmp_path),
        )

    with pytest.raises(ValueError, match="reduce_lr_on_plateau"):
        make(lr_scheduler_type="reduce_lr_on_plateau")
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        make(auto_find_batch_size=True)


# ------------------------------------------------------------------------------- a partitioned model
def test_stage3_model_streamed_from_a_checkpoint_into_partitions(tmp_path):
    """from_pretrained: the checkpoint goes straight into NVMe partitions (the model never whole in memory);
    the ZeroTrainer's engine takes them over and trains as the plain Trainer on the loaded model."""
    path = tmp_path / "pretrained"
    tiny_gpt2(seed=3).save_pretrained(str(path))
    want = logged(plain_run(tmp_path, model=AutoModelForCausalLM.from_pretrained(str(path))))

    cfg = zero_config(3, tmp_path)
    args = training_args(tmp_path / "zero")
    model = from_pretrained(str(path), cfg, args)
    big = [p for p in model.parameters() if p.ds_numel > 10 * HIDDEN]  # above the persistence threshold
    assert big and all(p.numel() == 0 and p.ds_tensor.final_location == "nvme" for p in big)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=token_ids(), zero_config=cfg)
    with pytest.raises(RuntimeError, match="evaluate or predict after train"):
        trainer.evaluate(token_ids(4))
    trainer.train()
    assert trainer.engine.partitioner is model.transformer.h[0].attn.c_attn.weight.ds_unit.owner  # taken over
    assert_same_run(logged(trainer), want)
    assert trainer.evaluate(token_ids(4))["eval_loss"] > 0  # through the engine once it exists


def test_load_best_model_at_end_puts_the_best_weights_into_the_engine(tmp_path):
    kw = dict(
        save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3, load_best_model_at_end=True
    )
    args = training_args(tmp_path / "zero", metric_for_best_model="loss", greater_is_better=True, **kw)
    trainer = ZeroTrainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=token_ids(),
        eval_dataset=token_ids(4),
        zero_config=zero_config(2, tmp_path),
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-3")  # the higher eval loss, so not the last checkpoint
    saved = AutoModelForCausalLM.from_pretrained(best).state_dict()
    for name, value in trainer.engine.consolidated_state_dict().items():
        assert torch.equal(saved[name], value), name


def test_stage3_model_built_under_zero_init(tmp_path):
    """A model built under zero.Init (config filled by fill_zero_config) is partitioned as it is built; the
    trainer's engine takes the partitions over and trains as the plain Trainer trains the same weights."""
    import zero

    cfg = zero_config(3, tmp_path)
    args = training_args(tmp_path / "zero")
    with zero.Init(config=fill_zero_config(cfg, args, tiny_gpt2().config)):
        model = GPT2LMHeadModel(tiny_gpt2().config)
    with zero.GatheredParameters(model.parameters()):
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    plain = tiny_gpt2()
    plain.load_state_dict(weights)
    want = logged(plain_run(tmp_path, model=plain))
    trainer = ZeroTrainer(model=model, args=args, train_dataset=token_ids(), zero_config=cfg)
    trainer.train()
    assert trainer.engine.partitioner is model.lm_head.weight.ds_unit.owner
    assert_same_run(logged(trainer), want)
