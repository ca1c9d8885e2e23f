"""Byte-level training data: the English text of ``pydoc_data.topics`` (ships with CPython, no download)."""

from __future__ import annotations

import torch

__all__ = ["load_text", "load_tokens", "split_tokens", "BatchSampler", "fixed_batches"]


def load_text() -> str:
    """The ``pydoc_data.topics`` values joined in sorted key order (about 465 kB of English)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_tokens() -> torch.Tensor:
    """The text as UTF-8 bytes in an int64 tensor (vocab 256)."""
    data = load_text().encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def split_tokens(tokens: torch.Tensor, eval_frac: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval): the last ``eval_frac`` of the tokens are held out for eval."""
    n_eval = int(len(tokens) * eval_frac)
    return tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval :]


class BatchSampler:
    """Draws (B, T+1) random windows from ``tokens`` with a seeded ``torch.Generator``.

    Two samplers built with the same arguments yield identical batches.  Each batch is returned as
    ``(inputs, targets)``, both (B, T) int64 on ``device``, ``targets`` shifted by one token.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, device="cpu") -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def next_window(self) -> torch.Tensor:
        """One (B, T+1) int64 batch of windows, on the CPU."""
        high = len(self.tokens) - self.seq_len  # exclusive upper bound of start offsets
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return self.tokens[starts[:, None] + self._offsets]

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.next_window().to(self.device, non_blocking=True)
        return w[:, :-1], w[:, 1:]


def fixed_batches(tokens: torch.Tensor, n: int, batch_size: int, seq_len: int, seed: int, device="cpu"):
    """A list of ``n`` deterministic ``(inputs, targets)`` batches (e.g. a fixed eval set)."""
    sampler = BatchSampler(tokens, batch_size, seq_len, seed, device)
    return [next(sampler) for _ in range(n)]
