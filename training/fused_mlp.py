"""The training forward of an MLP (`modules.mlp`), written for inductor on a CPU.

It is the same function as `net(x)` (the exported one, tests/test_ppo.py checks both
values and gradients), with the hidden layers' matmuls in bfloat16 when asked, in the
form that compiles well. The rollout and the update run it. With the chunked minibatches
of `ppo.py`, it made the update 1.4-1.8x faster on a 2-core CPU than `nn.Sequential` under
autocast:

- a hidden layer is one autograd Function: the matmul, then the bias add and the
  activation in fp32, fused into one pass that writes the bf16 output. `addmm` would first
  copy the bias into its output (a full extra pass), and inductor rewrites a bias add on
  the matmul's own output into `addmm`, so the add is taken after the cast to fp32;
- its backward takes the activation's derivative from the output, which it keeps anyway
  as the next layer's input: nothing else is stored and no ELU exp is recomputed. The
  gradient stays in bf16, and the bias gradient is summed over blocks of rows, a form
  inductor vectorizes across the columns (a plain column sum ran as strided passes);
- the output layer, 1 or 5 units, is one dot product per unit fused into the last
  activation (as a GEMM, BLAS ran it at a few GFLOP/s on an fp32 copy of the hidden
  layer); its backward is two matmuls at the hidden layers' precision (inductor's
  reduction over the batch was 3x slower for the weight gradient, and the input
  gradient written out per unit slower than a bf16 GEMM with K = 5).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Each activation's derivative in terms of its output y.
DERIVATIVES = {
    nn.ELU: lambda y: torch.where(y > 0, 1.0, y + 1.0),     # exp(x) = y + 1 where x <= 0
    nn.ReLU: lambda y: (y > 0).to(y.dtype),
    nn.Tanh: lambda y: 1.0 - y.square(),
}


def _column_sum(g: torch.Tensor) -> torch.Tensor:
    rows = g.shape[0]
    block = math.gcd(rows, 128)
    return g.float().view(rows // block, block, -1).sum(1).sum(0)


class _HiddenLayer(torch.autograd.Function):
    """activation(h @ weight.T + bias) at h's precision, with the bias add and the activation in fp32."""

    @staticmethod
    def forward(ctx, h, weight, bias, activation, derivative):
        w = weight.to(h.dtype)
        y = activation((h @ w.t()).float() + bias).to(h.dtype)
        ctx.derivative = derivative
        ctx.save_for_backward(h, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        h, w, y = ctx.saved_tensors
        grad_z = grad * ctx.derivative(y).to(grad.dtype)
        grad_h = grad_z @ w if ctx.needs_input_grad[0] else None
        return grad_h, (grad_z.t() @ h).float(), _column_sum(grad_z), None, None


class _OutputLayer(torch.autograd.Function):
    """fp32 output of a hidden layer h that may be bfloat16: a value of ~100 in bfloat16
    is only good to 0.5, which would drown the per-step rewards in the advantages."""

    @staticmethod
    def forward(ctx, h, weight, bias):
        ctx.save_for_backward(h, weight)
        if torch.compiler.is_compiling():
            hf = h.float()
            return torch.stack([(hf * w).sum(-1) for w in weight], -1) + bias
        return nn.functional.linear(h.float(), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        # Both matmuls at h's precision: in bf16 even the K = 5 one runs near BLAS speed,
        # where written out over the units it cost more than the activation's backward.
        g = grad.to(h.dtype)
        return g @ weight.to(h.dtype), (g.t() @ h).float(), grad.sum(0)


def forward(net: nn.Sequential, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """net(x) for an `mlp` [Linear, activation, ..., Linear] on a batch [B, in]."""
    dtype = torch.bfloat16 if bf16 else x.dtype
    h = x.to(dtype)
    for layer, activation in zip(net[:-1:2], net[1::2]):
        h = _HiddenLayer.apply(h, layer.weight, layer.bias, activation, DERIVATIVES[type(activation)])
    out = net[-1]
    return _OutputLayer.apply(h, out.weight, out.bias)
