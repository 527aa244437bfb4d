"""The training forward of an MLP (`modules.mlp`), written for inductor on a CPU.

It is the same function as `net(x)` (the exported one, tests/test_ppo.py checks both
values and gradients), with the hidden layers in bfloat16 when asked, in the form that
compiles well. The rollout and the update run it. With the chunked minibatches of
`ppo.py`, it made the update 1.4-1.8x faster on a 2-core CPU than `nn.Sequential` under
autocast:

- a hidden layer is a matmul plus a bias add that fuses into the activation (addmm
  first copies the bias into its output: a full extra pass over the activations);
- an activation's derivative comes from its output, which the backward pass keeps anyway
  as the next layer's input: nothing else is stored and no ELU exp is recomputed;
- the output layer, 1 or 5 units, is one dot product per unit fused into the last
  activation (as a GEMM, BLAS ran it at a few GFLOP/s on an fp32 copy of the hidden
  layer), and its weight gradient one matmul (inductor's reduction over the batch
  was 3x slower).
"""

from __future__ import annotations

import torch
from torch import nn

# Each activation's derivative in terms of its output y.
DERIVATIVES = {
    nn.ELU: lambda y: torch.where(y > 0, 1.0, y + 1.0),     # exp(x) = y + 1 where x <= 0
    nn.ReLU: lambda y: (y > 0).to(y.dtype),
    nn.Tanh: lambda y: 1.0 - y.square(),
}


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, derivative):
        y = activation(x)
        ctx.derivative = derivative
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * ctx.derivative(y).to(grad.dtype), None, None


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
        # grad @ weight, written out over the 1 or 5 units so that it fuses into the
        # activation's backward instead of running as a GEMM with K = 5.
        grad_h = sum(grad[:, j, None] * weight[j] for j in range(weight.shape[0])).to(h.dtype)
        grad_weight = (grad.t().to(h.dtype) @ h).float()
        return grad_h, grad_weight, grad.sum(0)


def forward(net: nn.Sequential, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """net(x) for an `mlp` [Linear, activation, ..., Linear] on a batch [B, in]."""
    dtype = torch.bfloat16 if bf16 else x.dtype
    h = x.to(dtype)
    for layer, activation in zip(net[:-1:2], net[1::2]):
        h = _Activation.apply(h @ layer.weight.to(dtype).t() + layer.bias.to(dtype), activation,
                              DERIVATIVES[type(activation)])
    out = net[-1]
    return _OutputLayer.apply(h, out.weight, out.bias)
