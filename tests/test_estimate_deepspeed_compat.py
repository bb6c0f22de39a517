"""--deepspeed-compat reproduces DeepSpeed's estimate_zero2/zero3_model_states_mem_needs_all_cold."""

from __future__ import annotations

from offload.estimate import deepspeed_rows, zero2_model_states, zero3_model_states

GIB = 2**30


def test_zero3_matches_deepspeed_docs_example():
    # DeepSpeed's memory docs: 2851M params, 32M largest layer, 1 node x 8 GPUs (per CPU / per GPU, GB=2**30)
    rows = deepspeed_rows(2851e6, 32e6, gpus_per_node=8, nodes=1, stages=[3])
    got = [(round(r.per_cpu_bytes / GIB, 2), round(r.per_gpu_bytes / GIB, 2)) for r in rows]
    assert got == [(71.69, 0.12), (127.45, 0.12), (63.72, 0.78), (127.45, 0.78), (1.43, 6.09), (127.45, 6.09)]
    assert [(r.offload_optimizer, r.offload_param, r.zero_init) for r in rows] == [
        ("cpu", "cpu", True),
        ("cpu", "cpu", False),
        ("cpu", "none", True),
        ("cpu", "none", False),
        ("none", "none", True),
        ("none", "none", False),
    ]


def test_zero3_bytes_hand_computed():
    # offload both, zero.Init: 18 B/param x 1.5 on the host; 4 B per largest-layer param on the GPU
    assert zero3_model_states(2851_000_000, 32_000_000, 8, 1, True, True, True) == (
        76_977_000_000,
        128_000_000,
    )
    # no offload: 4 B x L + 18 B x P / 8 on the GPU
    assert zero3_model_states(2851_000_000, 32_000_000, 8, 1, False, False, True) == (
        int(32_000_000 * 4 * 8 * 1.5),
        128_000_000 + int(18 * 2851_000_000 / 8),
    )


def test_zero2_bytes_hand_computed():
    assert zero2_model_states(1_000_000, 4, 2, cpu_offload=True) == (int(1_000_000 * 32 * 1.5), 2_000_000)
    assert zero2_model_states(1_000_000, 4, 2, cpu_offload=False) == (
        int(1_000_000 * 4 * 4 * 1.5),
        2_000_000 + int(18 * 1_000_000 / 8),
    )
    assert (
        zero2_model_states(1_000_000, 1, 1, cpu_offload=True, additional_buffer_factor=1.0)[0] == 16_000_000
    )


def test_rows_filter_and_label():
    rows = deepspeed_rows(1e9, 1e7, 8, 1)
    assert [r.stage for r in rows] == [2, 2, 3, 3, 3, 3, 3, 3]
    assert deepspeed_rows(1e9, 1e7, 8, 1, stages=[1])[0].stage == 1
    assert deepspeed_rows(1e9, 1e7, 8, 1, offload_optimizers=["nvme"]) == []
    only = deepspeed_rows(1e9, 1e7, 8, 1, stages=[3], offload_params=["cpu"])
    assert {(r.offload_optimizer, r.offload_param) for r in only} == {("cpu", "cpu")}
