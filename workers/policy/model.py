"""A tiny causal language model: the default policy of the reference agent and the logprob workers.

Parameters are plain tensors filled from one `torch.Generator`, so the same seed gives bit-identical
weights in every process and building a model never touches the global RNG.  The next-token logits are
exactly `final_hidden(ids) @ lm_head_weight.T (+ lm_head_bias)`, which is what the fused logprob kernels
consume; nothing else happens after the last hidden state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    max_seq_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.hidden < 1 or self.layers < 1 or self.max_seq_len < 2:
            raise ValueError(f"invalid tiny model config: {self}")
        if self.heads < 1 or self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1_w = nn.Parameter(torch.ones(hidden))
        self.ln1_b = nn.Parameter(torch.zeros(hidden))
        self.qkv = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.proj = nn.Parameter(torch.empty(hidden, hidden))
        self.ln2_w = nn.Parameter(torch.ones(hidden))
        self.ln2_b = nn.Parameter(torch.zeros(hidden))
        self.fc_in = nn.Parameter(torch.empty(4 * hidden, hidden))
        self.fc_out = nn.Parameter(torch.empty(hidden, 4 * hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        y = F.layer_norm(x, (h,), self.ln1_w, self.ln1_b)
        # [3, heads, T, head_dim]
        q, k, v = F.linear(y, self.qkv).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(att.transpose(0, 1).reshape(t, h), self.proj)
        y = F.layer_norm(x, (h,), self.ln2_w, self.ln2_b)
        return x + F.linear(F.gelu(F.linear(y, self.fc_in)), self.fc_out)


class TinyCausalLM(nn.Module):
    """Token + position embeddings, `layers` causal blocks, a final norm and an untied LM head."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.tok_emb = nn.Parameter(torch.empty(config.vocab_size, h))
        self.pos_emb = nn.Parameter(torch.empty(config.max_seq_len, h))
        self.blocks = nn.ModuleList(_Block(h, config.heads) for _ in range(config.layers))
        self.ln_f_w = nn.Parameter(torch.ones(h))
        self.ln_f_b = nn.Parameter(torch.zeros(h))
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, h))
        self._init_weights()
        self.eval()
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.config.seed)
        # Named order is fixed by construction, so the fill order (and the weights) never depend on dicts.
        for name, param in self.named_parameters():
            if name.split(".")[-1].startswith("ln"):
                continue  # norms keep their ones/zeros
            fan_in = param.shape[-1]
            std = 0.02 if "emb" in name else 1.0 / math.sqrt(fan_in)
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        with torch.no_grad():
            # A larger head spreads the next-token distribution so sampling is not near-uniform.
            self.lm_head.mul_(4.0)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, H]`: logits = final_hidden @ lm_head_weight.T."""
        return self.lm_head

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        return None

    def final_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids [T]` (int64) -> `[T, H]` hidden states after the final norm."""
        if ids.dim() != 1:
            raise ValueError(f"expected a 1-D token sequence, got shape {tuple(ids.shape)}")
        t = ids.shape[0]
        if not 0 < t <= self.config.max_seq_len:
            raise ValueError(f"sequence length {t} outside 1..{self.config.max_seq_len}")
        x = self.tok_emb[ids] + self.pos_emb[:t]
        for block in self.blocks:
            x = block(x)
        return F.layer_norm(x, (self.config.hidden,), self.ln_f_w, self.ln_f_b)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids [T]` -> next-token logits `[T, V]`."""
        return F.linear(self.final_hidden(ids), self.lm_head_weight, self.lm_head_bias)
