"""ZeroStrategy (zero/integrations/lightning.py): `lightning.Trainer(strategy="zero_offload")`.

A tiny Hugging Face GPT-2 LightningModule trains through the strategy and through Lightning's default
strategy with torch.optim.AdamW (same seed, same data); the losses agree to 1e-5 at stage 2 (optimizer in
host memory) and at stage 3 (parameters and optimizer on NVMe under tmp_path, the model built in
`configure_model` under zero.Init). A checkpoint saved mid-run (ModelCheckpoint at an epoch's end, or
`trainer.save_checkpoint` after a shorter fit) resumes with `fit(ckpt_path=...)` to the uninterrupted
run's losses, weights and learning rate bit for bit, dropout included (the engine restores the RNG).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")
transformers = pytest.importorskip("transformers")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from zero.integrations.lightning import ZeroPrecision, ZeroStrategy  # noqa: E402

pytestmark = [  # Lightning's notes about this tiny setup, not about the strategy
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks"),
]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ, SAMPLES, BATCH = 64, 16, 16, 4  # 4 batches per epoch


class TinyGPT(L.LightningModule):
    """GPT-2 (2 layers, width 32) from a config; built in __init__ or in configure_model."""

    def __init__(self, in_configure_model: bool = False, dropout: float = 0.0, scheduler: bool = True):
        super().__init__()
        self.save_hyperparameters()  # plain values: they travel in the checkpoint's client state
        self.model = None
        self.losses: list = []
        self.partitioned_when_built = None
        if not in_configure_model:
            self.configure_model()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        d = self.hparams.dropout
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=d, embd_pdrop=d, attn_pdrop=d, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(cfg)
        self.partitioned_when_built = all(p.numel() == 0 for p in self.model.parameters())
        # Initialised from a generator of its own (nn.Module.apply, gathered under zero.Init): both strategies
        # start from the same weights whatever else consumed the global RNG.
        gen = torch.Generator().manual_seed(0)
        self.model.apply(lambda m: _init_weights(m, gen))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.25 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _init_weights(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, torch.nn.LayerNorm):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _loader() -> DataLoader:
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


def _trainer(strategy, max_epochs: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks), num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def _fit(strategy, max_epochs: int, module_kwargs=None, ckpt_path=None, callbacks=(), **kwargs):
    torch.manual_seed(0)
    module = TinyGPT(**(module_kwargs or {}))
    trainer = _trainer(strategy, max_epochs, callbacks, **kwargs)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return module, trainer


def _weights(module, trainer) -> dict:
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        return strategy.engine.consolidated_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _close(a: dict, b: dict, atol: float) -> None:
    """Every weight within `atol`, except the attention's key bias: softmax ignores it, so its gradient is
    rounding noise (~1e-10) that Adam scales to whole steps of either sign - its values are only bounded
    by the learning rate times the steps taken."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].float(), b[k].float()
        if k.endswith("attn.c_attn.bias"):
            keys = slice(x.numel() // 3, 2 * x.numel() // 3)
            assert (x[keys] - y[keys]).abs().max().item() <= 3e-3 * 8
            x[keys], y[keys] = 0.0, 0.0
        assert (x - y).abs().max().item() <= atol, k


def _stage3_nvme(path) -> dict:
    os.makedirs(path, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": str(path)}
    return {"zero_optimization": {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme)}}


# ------------------------------------------------------------------------------------------- the name
def test_importing_zero_integrations_does_not_import_lightning():
    code = "import sys, zero.integrations; assert 'lightning' not in sys.modules, 'lightning imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_strategy_resolves_by_name():
    assert StrategyRegistry["zero_offload"]["strategy"] is ZeroStrategy
    trainer = _trainer("zero_offload", 1)
    assert type(trainer.strategy) is ZeroStrategy
    zo = trainer.strategy.config["zero_optimization"]
    assert zo == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert trainer.precision_plugin.dtype == torch.float32
    stage3 = _trainer("zero_offload_stage_3", 1, precision="bf16-mixed").strategy
    assert stage3.config["zero_optimization"]["stage"] == 3
    assert stage3.config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert stage3.precision_plugin.config_key == "bf16"
    with pytest.raises(ValueError, match="precision='64-true'"):
        _trainer("zero_offload", 1, precision="64-true")


# ---------------------------------------------------------------------------------------- the config
def test_deepspeed_arguments_map_into_the_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 7}))
    s = ZeroStrategy(
        config=str(path), stage=3, offload_optimizer_device="nvme", offload_parameters=True,
        nvme_path=str(tmp_path), sub_group_size=4096, thread_count=2, loss_scale_window=50,
        logging_batch_size_per_gpu=4, zero_allow_untested_optimizer=True,
    )  # fmt: skip
    zo = s.config["zero_optimization"]
    assert zo["stage"] == 3 and zo["sub_group_size"] == 4096
    assert zo["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path)}
    assert zo["offload_param"] == {"device": "cpu"}
    assert s.config["aio"] == {"thread_count": 2} and s.config["fp16"] == {"loss_scale_window": 50}
    assert s.config["steps_per_print"] == 7 and s.config["train_micro_batch_size_per_gpu"] == 4
    assert ZeroStrategy(offload_optimizer=False).config["zero_optimization"]["offload_optimizer"] == {
        "device": "none"
    }
    refused = [
        (dict(remote_device="nvme"), ValueError, "remote_device"),
        (dict(load_full_weights=True), ValueError, "load_full_weights"),
        (dict(exclude_frozen_parameters=True), ValueError, "exclude_frozen_parameters"),
        (dict(process_group_backend="gloo"), ValueError, "runs one process"),
        (dict(no_such_option=1), TypeError, "no_such_option"),
        (dict(nvme_path="/x"), ValueError, "nothing is offloaded to nvme"),
        (dict(offload_parameters=True), ValueError, "needs stage 3"),
        (dict(offload_optimizer=False, offload_optimizer_device="cpu"), ValueError, "offloading is off"),
        (dict(config=str(tmp_path / "missing.json")), FileNotFoundError, "missing.json"),
    ]
    for kwargs, error, match in refused:
        with pytest.raises(error, match=match):
            ZeroStrategy(**kwargs)


@pytest.mark.parametrize(
    "config, trainer_kwargs, match",
    [
        ({"gradient_accumulation_steps": 4}, {"accumulate_grad_batches": 2}, "gradient_accumulation_steps=4"),
        ({"gradient_clipping": 2.0}, {"gradient_clip_val": 1.0}, "gradient_clipping=2.0"),
        ({}, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, "global norm only"),
        ({"bf16": {"enabled": True}}, {}, "precision='32-true'"),
    ],
)
def test_config_conflicting_with_the_trainer_is_refused(config, trainer_kwargs, match):
    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 2}, **config})
    with pytest.raises(ValueError, match=match):
        _fit(strategy, 1, **trainer_kwargs)


def test_bf16_accumulation_and_clipping_come_from_the_trainer():
    strategy = ZeroStrategy()
    module, trainer = _fit(
        strategy, 1, precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5, max_steps=1
    )
    cfg = strategy.config
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 0.5
    engine = strategy.engine
    assert engine.dtype == torch.bfloat16 and engine.gradient_accumulation_steps() == 2
    assert engine.global_steps == trainer.global_step == 1 and len(module.losses) == 2
    assert all(torch.isfinite(loss) for loss in module.losses)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        strategy.load_checkpoint(__file__)


# ------------------------------------------------------------------------------ against plain Lightning
def test_stage2_cpu_offload_matches_lightning_default():
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    ref, ref_trainer = _fit("auto", 2, **kwargs)
    ours, trainer = _fit(ZeroStrategy(), 2, **kwargs)
    assert len(ours.losses) == len(ref.losses) == 8
    diff = (torch.stack(ours.losses) - torch.stack(ref.losses)).abs().max().item()
    assert diff <= 1e-5, diff
    _close(_weights(ours, trainer), _weights(ref, ref_trainer), 1e-5)
    engine = trainer.strategy.engine
    assert engine.global_steps == trainer.global_step == ref_trainer.global_step == 4
    assert engine.optimizer_state_info().tier == "cpu" and engine.stage == 2
    lr = ref_trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert engine.get_lr() == pytest.approx(lr, rel=1e-12)
    # validate after fit reuses the engine
    ours_val = trainer.validate(ours, _loader(), verbose=False)[0]["val_loss"]
    ref_val = ref_trainer.validate(ref, _loader(), verbose=False)[0]["val_loss"]
    assert trainer.strategy.engine is engine
    assert abs(ours_val - ref_val) <= 1e-5


def test_stage3_nvme_matches_lightning_default(tmp_path):
    module_kwargs = dict(in_configure_model=True, scheduler=False)
    ref, ref_trainer = _fit("auto", 2, module_kwargs)
    ours, trainer = _fit(ZeroStrategy(config=_stage3_nvme(tmp_path)), 2, module_kwargs)
    assert ref.partitioned_when_built is False and ours.partitioned_when_built is True  # under zero.Init
    diff = (torch.stack(ours.losses) - torch.stack(ref.losses)).abs().max().item()
    assert diff <= 1e-5, diff
    _close(_weights(ours, trainer), _weights(ref, ref_trainer), 1e-5)
    engine = trainer.strategy.engine
    assert engine.stage == 3 and engine.optimizer_state_info().tier == "nvme"
    assert engine.partitioner.store.tier == "nvme"


class ManualGPT(TinyGPT):
    """Manual optimization: the training step calls zero_grad, manual_backward and step itself."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.detach().clone())
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_config_optimizer_and_validate_without_fit():
    ref, ours = [], []
    for strategy, out in (("auto", ref), (ZeroStrategy(), ours)):
        torch.manual_seed(0)
        module = ManualGPT()
        _trainer(strategy, 1).fit(module, _loader())
        out.extend(module.losses)
    assert torch.equal(torch.stack(ours), torch.stack(ref))
    # the config's optimizer block: configure_optimizers is not called (it would return AdamW at 3e-3)
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    module, trainer = _fit(ZeroStrategy(config=config), 1)
    assert trainer.strategy.engine.get_lr() == [1e-4] and trainer.lr_scheduler_configs == []
    # validate before any fit: an inference engine (no optimizer), the default strategy's loss
    losses = []
    for strategy in ("auto", ZeroStrategy(stage=3)):
        torch.manual_seed(0)
        trainer = _trainer(strategy, 1)
        losses.append(trainer.validate(TinyGPT(in_configure_model=True), _loader(), verbose=False)[0])
    assert trainer.strategy.engine.optimizer is None and trainer.strategy.engine.stage == 3
    assert losses[1]["val_loss"] == pytest.approx(losses[0]["val_loss"], abs=1e-6)


# ------------------------------------------------------------------------------------------ resuming
def test_resume_from_a_mid_run_checkpoint_is_bit_exact(tmp_path):
    """Stage 2, dropout on, an LR scheduler: ModelCheckpoint saves at each epoch's end."""
    module_kwargs = dict(dropout=0.1)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    full, full_trainer = _fit(ZeroStrategy(), 3, module_kwargs, callbacks=[saver])
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    assert (ckpt / "latest").is_file() and (ckpt / "checkpoint" / "manifest.json").is_file()
    resumed, trainer = _fit(ZeroStrategy(), 3, module_kwargs, ckpt_path=str(ckpt))
    assert len(resumed.losses) == 8 and torch.equal(torch.stack(resumed.losses), torch.stack(full.losses[4:]))
    a, b = _weights(full, full_trainer), _weights(resumed, trainer)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert trainer.global_step == full_trainer.global_step == 12
    assert trainer.strategy.engine.get_lr() == full_trainer.strategy.engine.get_lr()
    sched, full_sched = (t.lr_scheduler_configs[0].scheduler for t in (trainer, full_trainer))
    assert sched.last_epoch == full_sched.last_epoch == 12
    m, f = (t.strategy.engine.fp32_master_state_dict() for t in (trainer, full_trainer))
    assert all(torch.equal(m[k], f[k]) for k in m)


def test_stage3_nvme_save_checkpoint_then_resume_is_bit_exact(tmp_path):
    """Stage 3 on NVMe: `trainer.save_checkpoint(path)` after one epoch, `fit(ckpt_path=path)` for the
    second equals two epochs in one run."""
    module_kwargs = dict(in_configure_model=True, scheduler=False)
    full, full_trainer = _fit(ZeroStrategy(config=_stage3_nvme(tmp_path / "a")), 2, module_kwargs)
    first, first_trainer = _fit(ZeroStrategy(config=_stage3_nvme(tmp_path / "b")), 1, module_kwargs)
    path = tmp_path / "after-epoch-0.ckpt"
    first_trainer.save_checkpoint(path)
    first_trainer.strategy.close()
    resumed, trainer = _fit(ZeroStrategy(config=_stage3_nvme(tmp_path / "c")), 2, module_kwargs, str(path))
    assert torch.equal(torch.stack(first.losses + resumed.losses), torch.stack(full.losses))
    a, b = _weights(full, full_trainer), _weights(resumed, trainer)
    assert all(torch.equal(a[k], b[k]) for k in a)
