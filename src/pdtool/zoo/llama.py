"""A Llama written the way torchtitan writes its models, so that a plan of it exports to torchtitan.

Llama-3's decoder (Touvron et al. 2023; Grattafiori et al. 2024): RMSNorm pre-norm blocks of
grouped-query attention with rotary position embeddings and a SwiGLU feed-forward, an untied
output head. The module tree is torchtitan's (`torchtitan/models/llama3/model`): `tok_embeddings`,
`layers` (an `nn.ModuleDict` keyed "0", "1", ...), `norm`, `output`; and so is its forward, which
skips a module that was removed (`None`) or a layer deleted from the dict. That is the mechanism
torchtitan's pipelining uses to build a stage (a copy of the model with the modules of other
stages removed), so the module names of this model's profile are the names
`pd export-plan --to torchtitan|pipelining` writes and torchtitan finds (docs/export-plan.md).

Rotary embeddings use real cos/sin tables (torchtitan's complex `freqs_cis`, the same rotation)
held as a non-persistent buffer on the model, as torchtitan holds `freqs_cis`: every stage has it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..consent import factory
from ..model.spec import ModelBundle


def _rotary_tables(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of each position's rotation angles, shape (2, seq_len, head_dim / 2)."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inverse)
    return torch.stack((angles.cos(), angles.sin()))


def _rotate(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x's last dimension (batch, seq, heads, head_dim) by the position's angles."""
    cos, sin = tables[0][None, :, None, :], tables[1][None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim)
        q, k = _rotate(q, rotary), _rotate(k, rotary)
        repeat = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotary)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama-3 module tree; a removed module (None) or a deleted layer is skipped."""

    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int,
                 theta: float = 500000.0, eps: float = 1e-5):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("rotary", _rotary_tables(dim // heads, seq_len, theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads, kv_heads, hidden, eps)
                                     for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rotary)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


@factory
def llama(vocab: int = 128256, seq_len: int = 8192, dim: int = 4096, layers: int = 32, heads: int = 32,
          kv_heads: int = 8, hidden: int = 14336) -> ModelBundle:
    """torchtitan's Llama-3 on token sequences of exactly `seq_len`; the defaults are Llama-3 8B."""
    if dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}) with an even head size, and heads a "
                         f"multiple of kv_heads ({kv_heads})")
    module = Transformer(vocab, seq_len, dim, layers, heads, kv_heads, hidden)

    def make_batch(batch_size: int):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
        return tokens[:, :-1], tokens[:, 1:]

    return ModelBundle(module=module, make_batch=make_batch, loss_fn=next_token_loss)
