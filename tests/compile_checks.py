"""A helper the torch.compile tests share (``test_weight``, ``test_integrations``).  Not a test module."""

from __future__ import annotations

import torch


def assert_compile_matches_eager(module: torch.nn.Module, args: tuple, backend: str = "inductor") -> None:
    """``torch.compile(module, fullgraph=True, backend=backend)`` gives eager's output, input gradient and
    parameter gradients (loss ``sum(y ** 2)``) within 1e-5; ``args[0]`` is the differentiable input."""
    outs, grads = [], []
    for fn in (module, torch.compile(module, fullgraph=True, backend=backend)):
        x = args[0].clone().requires_grad_()
        y = fn(x, *args[1:])
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([x.grad, *[p.grad.clone() for p in module.parameters()]])
        module.zero_grad()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for g_compiled, g_eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_compiled, g_eager, rtol=1e-5, atol=1e-5)
