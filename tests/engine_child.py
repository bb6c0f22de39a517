"""The common start of the child scripts that make an optimizer-state write fail under RLIMIT_FSIZE
(process-wide, hence a child): a small GPT trained 4 steps with the optimizer on NVMe as the reference.

Defines `engine()`, `fwd_bwd(e, step)`, `want` (the reference losses), `ref_state` and `ref_params`; the
swap directory comes from argv[1]. Writes that exceed the limit get EFBIG instead of a fatal SIGXFSZ."""

from __future__ import annotations

import textwrap

ENGINE_CHILD_PRELUDE = textwrap.dedent(
    """
    import errno, json, resource, signal, sys, torch
    import zero
    from offload.swap.optimizer_swapper import DeferredWriteError
    from zero.models import GPT, GPTConfig, corpus_bytes, get_batch

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(), not a fatal signal
    nvme = sys.argv[1]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 0, "sub_group_size": 8192,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3},
        },
    }
    model_cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
    data = corpus_bytes()

    def engine():
        torch.manual_seed(0)
        return zero.initialize(model=GPT(model_cfg), config=cfg)[0]

    def fwd_bwd(e, step):
        x, y = get_batch(data, 2, 16, step)
        loss = e(x, y)
        e.backward(loss)
        return loss.item()

    ref = engine()
    want = []
    for s in range(4):
        want.append(fwd_bwd(ref, s))
        ref.step()
    ref_state = ref.optimizer.state_dict()
    ref_params = [p.detach().clone() for p in ref.module.parameters()]
    ref.close()
    """
)
