"""Parameter groups with their own hyperparameters (no weight decay on biases and norms, a second lr): torch's
`param_groups` semantics at every stage and tier, against torch AdamW and the CPU kernels' own optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model

import zero
from offload.config import load_config
from offload.ops import CPUAdamW
from zero.examples.models import get_batch

STEPS = 3


def hf_groups(model, lr2=3e-3):
    """Hugging Face's two groups (no decay for biases and LayerNorm weights), the second with its own lr."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr2}]


def interleaved_groups(model):
    """Groups whose parameters alternate in the model's order (stage 3 keeps the model's order: its chunks
    cross groups many times; stages 0-2 lay the groups' parameters out in the groups' order)."""
    params = list(model.parameters())
    return [
        {"params": params[1::2], "weight_decay": 0.0, "lr": 2e-3, "eps": 1e-6},
        {"params": params[0::2], "weight_decay": 0.2, "betas": (0.8, 0.9)},
    ]


def run_reference(opt_cls, make_groups, steps=STEPS, sched=None):
    model = make_model()
    opt = opt_cls(make_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    scheduler = sched(opt) if sched is not None else None
    for step in range(steps):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_for(tmp, stage, tier, make_groups, sched=None, **zo):
    model = make_model()
    cfg = base_config(tier, tmp, stage=stage)
    cfg["optimizer"]["params"].pop("weight_decay")  # each group says its own
    cfg["zero_optimization"].update(zo)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if tier != "none":
            cfg["zero_optimization"]["offload_param"] = {
                "device": tier,
                "nvme_path": str(tmp),
                "max_in_cpu": 0,
            }
    engine, *_ = zero.initialize(
        model=model, model_parameters=make_groups(model), config=cfg, lr_scheduler=sched
    )
    return engine


def train(engine, first=0, steps=STEPS):
    for step in range(first, first + steps):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        engine.step()


@pytest.fixture(scope="module")
def kernel_reference():
    """The CPU kernels' own optimizer (offload.ops.CPUAdamW) over the same groups: the engine's update rule,
    so every tier must give its bits."""
    return {
        "hf": run_reference(CPUAdamW, hf_groups),
        "interleaved": run_reference(CPUAdamW, interleaved_groups),
    }


PLACES = [
    (0, "none", {}),
    (1, "cpu", {}),
    (2, "cpu", {"sub_group_size": 1024}),
    (2, "nvme", {"sub_group_size": 1024}),
    (3, "none", {}),
    (3, "cpu", {}),
    (3, "nvme", {}),
]


@pytest.mark.parametrize("stage,tier,zo", PLACES)
@pytest.mark.parametrize("groups", ["hf", "interleaved"])
def test_groups_match_torch_adamw_bit_for_bit_with_the_kernels(
    tmp_path, kernel_reference, stage, tier, zo, groups
):
    """Each group's lr, betas, eps and weight decay at every stage and tier: bit-identical to the kernels'
    optimizer with the same groups, and within rounding of torch.optim.AdamW."""
    make = hf_groups if groups == "hf" else interleaved_groups
    engine = engine_for(tmp_path, stage, tier, make, **zo)
    assert len(engine.optimizer.param_groups) == 2
    train(engine)
    got = zero.consolidated_state_dict(engine)
    want = kernel_reference[groups]
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    engine.close()


def test_kernels_reference_is_torch_adamw():
    """The bit-exact reference above follows torch AdamW with the same groups (the kernel rounds
    differently, ~1e-7 per step), and per-group values matter (one set of hyperparameters is far off)."""
    kernels = run_reference(CPUAdamW, interleaved_groups)
    torch_ref = run_reference(torch.optim.AdamW, interleaved_groups)
    one_set = run_reference(torch.optim.AdamW, lambda m: m.parameters())
    for name, value in torch_ref.items():
        assert (kernels[name] - value).abs().max().item() <= 2e-5, name
    assert max((one_set[n] - v).abs().max().item() for n, v in torch_ref.items()) > 1e-4


def test_split_state_and_twin_flow_share_keep_each_groups_values(tmp_path, kernel_reference):
    """A state split between pinned memory and NVMe (max_in_cpu), and a Twin-Flow device share stepped by
    torch (ratio below 1.0): per-group hyperparameters in both shares."""
    model = make_model()
    cfg = base_config("nvme", tmp_path, stage=2)
    cfg["optimizer"]["params"].pop("weight_decay")
    cfg["zero_optimization"]["sub_group_size"] = 1024
    cfg["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = 20480
    engine, *_ = zero.initialize(model=model, model_parameters=interleaved_groups(model), config=cfg)
    info = engine.optimizer_state_info()
    assert info.resident_numel > 0 and info.swapped_numel > 0
    train(engine)
    got = zero.consolidated_state_dict(engine)
    assert all(torch.equal(got[n], v) for n, v in kernel_reference["interleaved"].items())
    engine.close()

    torch_ref = run_reference(torch.optim.AdamW, interleaved_groups)
    model = make_model()
    cfg = base_config("cpu", tmp_path, stage=2)
    cfg["optimizer"]["params"].pop("weight_decay")
    cfg["zero_optimization"]["sub_group_size"] = 1024
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    groups = interleaved_groups(model)
    engine = zero.ZeroEngine(model, load_config(cfg), model_parameters=groups, device_part="torch")
    info = engine.optimizer_state_info()
    assert info.device_part == "torch" and info.device_numel > 0
    train(engine)
    got = zero.consolidated_state_dict(engine)
    for name, value in torch_ref.items():
        assert (got[name] - value).abs().max().item() <= 2e-5, name
    engine.close()


def test_param_groups_are_torchs(tmp_path):
    """`optimizer.param_groups[i]["lr"]` is read and written as torch's; a scheduler scales each group from
    its own base lr; the engine's next step uses what was written."""
    lam = lambda step: 0.5 ** (step + 1)  # noqa: E731
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam)  # noqa: E731
    engine = engine_for(tmp_path, 2, "cpu", hf_groups, sched=sched)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-3 * 0.5, 3e-3 * 0.5]
    train(engine)
    assert engine.get_lr() == [1e-3 * 0.5**4, 3e-3 * 0.5**4]
    got = zero.consolidated_state_dict(engine)
    want = run_reference(CPUAdamW, hf_groups, sched=sched)
    assert all(torch.equal(got[n], v) for n, v in want.items())
    engine.close()

    engine = engine_for(tmp_path, 0, "none", hf_groups)
    engine.optimizer.param_groups[1]["lr"] = 0.0  # freeze the no-decay group by its lr
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.ndim < 2}
    train(engine, steps=1)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n].detach(), v) for n, v in before.items())
    engine.close()


@pytest.mark.parametrize("stage,tier", [(2, "nvme"), (3, "cpu")])
def test_checkpoint_keeps_each_groups_hyperparameters_and_resumes_bit_for_bit(tmp_path, stage, tier):
    a = engine_for(tmp_path, stage, tier, hf_groups)
    train(a, 0, 2)
    a.optimizer.param_groups[1]["lr"] = 7e-3  # changed after build: the checkpoint keeps it
    a.save_checkpoint(str(tmp_path / "ck"), tag="t")
    train(a, 2, 2)
    want = copy.deepcopy(zero.consolidated_state_dict(a))
    a.close()

    b = engine_for(tmp_path, stage, tier, hf_groups)
    b.load_checkpoint(str(tmp_path / "ck"), tag="t")
    assert [g["lr"] for g in b.optimizer.param_groups] == [1e-3, 7e-3]
    assert [g["weight_decay"] for g in b.optimizer.param_groups] == [0.1, 0.0]
    train(b, 2, 2)
    got = zero.consolidated_state_dict(b)
    assert all(torch.equal(got[k], want[k]) for k in want)
    b.close()

    c = engine_for(tmp_path, stage, tier, lambda m: m.parameters())  # one group: refused before anything
    with pytest.raises(ValueError, match=r"2 param group\(s\), this one 1"):
        c.load_checkpoint(str(tmp_path / "ck"), tag="t")
    c.close()


def test_groups_given_as_a_generator_are_kept(tmp_path):
    model = make_model()
    cfg = base_config("cpu", tmp_path, stage=1)
    engine, *_ = zero.initialize(model=model, model_parameters=iter(hf_groups(model)), config=cfg)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    engine.close()


def test_client_optimizer_groups_are_taken(tmp_path):
    """A client torch AdamW with two groups: the engine takes each group's hyperparameters."""
    model = make_model()
    client = torch.optim.AdamW(hf_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    cfg = base_config("cpu", tmp_path, stage=2)
    del cfg["optimizer"]
    engine, *_ = zero.initialize(model=model, optimizer=client, config=cfg)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    train(engine)
    got = zero.consolidated_state_dict(engine)
    want = run_reference(CPUAdamW, hf_groups)
    assert all(torch.equal(got[n], v) for n, v in want.items())
    engine.close()


def test_int8_states_with_different_groups_are_refused(tmp_path):
    model = make_model()
    cfg = base_config("cpu", tmp_path, stage=2)
    cfg["optimizer"]["params"]["state_dtype"] = "int8"
    with pytest.raises(ValueError, match="int8.*param groups of different hyperparameters"):
        zero.initialize(model=model, model_parameters=hf_groups(model), config=cfg)


@pytest.mark.parametrize("fused", [False, True])
def test_torch_device_step_over_runs_is_torch_adamw_with_the_groups(fused):
    """What steps the state with torch (the device without offload on CUDA, a Twin-Flow device share): one
    torch param per run of a group, over views of the flat master, gives torch AdamW's bits over the same
    groups (fused: the implementation used on CUDA, here on the CPU)."""
    from zero.optimizer.param_groups import group_spans
    from zero.optimizer.tiers.device_part import TorchAdamSpans

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 8, 2, 6)]
    groups = [
        {"params": [params[1], params[3]], "lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0},
        {
            "params": [params[0], params[2], params[4]],
            "lr": 1e-3,
            "betas": (0.9, 0.99),
            "eps": 1e-8,
            "weight_decay": 0.1,
        },
    ]
    for g in groups:
        g["adamw_mode"] = True
    offsets = [0, 5, 8, 16, 18]
    numel = 24
    master = torch.cat([p.detach() for p in params])
    states = [torch.zeros(numel), torch.zeros(numel)]
    spans = group_spans([(o, o + p.numel(), p) for o, p in zip(offsets, params)], groups, numel)
    assert len(spans) == 5  # the groups alternate
    stepper = TorchAdamSpans(groups, spans, master, states, fused=fused)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = {id(p): r for p, r in zip(params, ref)}
    hyper = [{k: v for k, v in g.items() if k not in ("params", "adamw_mode")} for g in groups]
    ref_groups = [{**h, "params": [twin[id(p)] for p in g["params"]]} for h, g in zip(hyper, groups)]
    opt = torch.optim.AdamW(ref_groups, **({"fused": True} if fused else {"foreach": False}))
    for step in range(1, 4):
        grads = [torch.randn(p.numel()) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        stepper.step(torch.cat(grads), step, groups)
    assert torch.equal(master, torch.cat([r.detach() for r in ref]))
