"""Low-bit state updates composed from torch ops around the fp32 kernel: widen the states to fp32, run
the fp32 update, store back (8-bit: re-quantize per block; bf16: stochastic rounding).

This is the statement of what the fused C++ low-bit kernels compute, kept as their bit-exact reference.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .quant import dequantize_blockwise, quantize_blockwise, round_bf16_stochastic, sr_bits

# Which 16 of the 32 random bits each state uses: the high half for the first state (exp_avg, Adagrad's
# sum), the low half for the second (exp_avg_sq).
_SR_SHIFT = (16, 0)


def update_lowbit(
    fp32_update: Callable[..., bool],
    states: Dict[str, torch.Tensor],
    absmax: Dict[str, Optional[torch.Tensor]],
    signed: Dict[str, bool],
    stochastic_rounding: bool,
    seed: int,
    step: int,
) -> bool:
    """Runs `fp32_update(*fp32_states)` on widened copies of `states` and stores them back.

    uint8 states are dequantized with their absmax and re-quantized (codes and absmax written in place);
    bf16 states with stochastic_rounding are rounded with the bits of (seed, step, element index). When
    fp32_update returns False having written nothing (check_finite), the states are left alone too; the
    caller passes check_finite through, so False with check_finite means nothing was written.
    """
    names = list(states)
    if states[names[0]].dtype == torch.uint8:
        wide = [dequantize_blockwise(states[k], absmax[k], signed[k]) for k in names]
    else:
        wide = [states[k].to(torch.float32) for k in names]
    ok, wrote = fp32_update(*wide)
    if not wrote:
        return ok
    if states[names[0]].dtype == torch.uint8:
        for k, w in zip(names, wide):
            q, a = quantize_blockwise(w, signed[k])
            states[k].copy_(q)
            absmax[k].reshape(-1).copy_(a)
    else:
        bits = sr_bits(states[names[0]].numel(), seed, step)
        for k, w, shift in zip(names, wide, _SR_SHIFT):
            states[k].copy_(round_bf16_stochastic(w, (bits >> shift) & 0xFFFF))
    return ok
