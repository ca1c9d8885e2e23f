"""A small Llama-style byte-level decoder LM in plain torch, used by ``python -m cute_mxfp8 train``.

Module names follow torchtitan so the MXFP8 converter sees familiar targets:
attention ``wq``/``wk``/``wv``/``wo``, dense FFN ``FeedForward.w1``/``w2``/``w3`` (``nn.Linear``, no bias),
MoE FFN ``MoE.gate`` (router, ``num_experts`` outputs) and ``MoE.experts`` (``GroupedExperts`` holding 3d
parameters ``w1`` (E, hidden, dim), ``w2`` (E, dim, hidden), ``w3`` (E, hidden, dim)).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelConfig",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "TransformerBlock",
    "Transformer",
]


@dataclass
class ModelConfig:
    """Model hyper-parameters.  ``dim``, ``hidden`` and ``dim // heads`` should be multiples of 32 for MXFP8."""

    vocab_size: int = 256
    dim: int = 128
    hidden: int = 384
    layers: int = 2
    heads: int = 4
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: bool = False
    num_experts: int = 4
    top_k: int = 2
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "hidden", "layers", "heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"head dim {self.dim // self.heads} must be even for RoPE")
        if self.moe and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2) for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of x (B, H, T, hd) by the angles in cos/sin (T, hd/2)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE (``F.scaled_dot_product_attention``, ``is_causal=True``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU FFN: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as 3d weights; a python loop runs one expert per contiguous group of rows."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (T, dim) sorted by expert; ``num_tokens_per_expert`` int (E,) summing to T.  Returns (T, dim)."""
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        outs = []
        for e, x_e in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(x_e @ self.w1[e].T) * (x_e @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Top-k softmax-routed mixture of experts; the router ``gate`` is a plain ``nn.Linear(dim, E)``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # Route in fp32; renormalize the top-k probabilities so each token's weights sum to 1.
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        weights = weights / weights.sum(-1, keepdim=True)
        flat_experts = experts.reshape(-1)  # (T*k,)
        order = torch.argsort(flat_experts, stable=True)
        token_idx = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        y = self.experts(x[token_idx], counts)  # (T*k, dim), sorted by expert
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros(x.shape[0], y.shape[-1], dtype=y.dtype, device=y.device)
        out.index_add_(0, token_idx, y)
        return out.reshape(shape[:-1] + (y.shape[-1],))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.moe:
            self.feed_forward: nn.Module = MoE(cfg.dim, cfg.hidden, cfg.num_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Byte-level decoder LM: embedding, ``layers`` blocks, final RMSNorm, ``output`` head (dim -> vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, std) everywhere; residual output projections (``wo``, ``w2``) scaled by 1/sqrt(2*layers)."""
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(p, std=resid_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab)."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (computed in fp32)."""
        logits = self(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
