"""A GPT-style decoder-only transformer language model (Radford et al. 2019, as in nanoGPT).

Pre-norm blocks of causal self-attention and a GELU MLP; learned position embeddings for a
fixed sequence length; the output head is not tied to the token embedding, so that the two
can live on different pipeline stages.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..consent import factory
from ..model.spec import ModelBundle


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.d_model = d_model
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, layers: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(1, seq_len, d_model))
        nn.init.normal_(self.pos_emb, std=0.02)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.tok_emb(idx) + self.pos_emb)))


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@factory
def gpt(vocab: int = 50257, seq_len: int = 1024, d_model: int = 768, heads: int = 12,
        layers: int = 12) -> ModelBundle:
    """GPT on token sequences of exactly `seq_len`; the defaults are GPT-2 small (124M)."""
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
    module = GPT(vocab, seq_len, d_model, heads, layers)

    def make_batch(batch_size: int):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
        return tokens[:, :-1], tokens[:, 1:]

    return ModelBundle(module=module, make_batch=make_batch, loss_fn=_next_token_loss)
