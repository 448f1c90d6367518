"""Hugging Face `transformers` models, built from configs with random weights (nothing downloaded).

Use them as `pd profile --model pdtool.zoo.hf:gpt2 -a n_layer=4 ...` after `pip install -e
'.[hf]'`. torch.fx cannot trace these models; pdtool captures them with torch.export, and
`pd train` splits that graph. Every factory returns a `ModelBundle` whose batches are random
token sequences; the defaults are small enough for a laptop, the published sizes a few
keyword arguments away (GPT-2 small: `n_embd=768 n_head=12 n_layer=12 vocab=50257`).

- `gpt2`: `GPT2LMHeadModel`, next-token loss; its output head is tied to the token embedding.
- `bert`: `BertForSequenceClassification`, cross entropy over `classes` labels.
- `llama`: `LlamaForCausalLM` (RoPE, RMSNorm, SwiGLU, grouped-query attention), next-token loss.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..consent import factory
from ..model.spec import ModelBundle


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("these models need the transformers package: pip install -e '.[hf]'") from None
    transformers.logging.set_verbosity_error()  # a random-weight model is what we ask for: no warnings
    return transformers


def _next_token_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _classification_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits, target)


def _tokens(vocab: int, seq_len: int):
    def make_batch(batch_size: int):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
        return tokens[:, :-1], tokens[:, 1:]
    return make_batch


@factory
def gpt2(vocab: int = 2048, seq_len: int = 64, n_embd: int = 256, n_head: int = 4, n_layer: int = 4,
         dropout: float = 0.0, tie: bool = True) -> ModelBundle:
    """GPT-2 (`GPT2LMHeadModel`) on token sequences of `seq_len`; `tie` ties the output head to
    the token embedding, as GPT-2 does."""
    hf = _transformers()
    config = hf.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                           resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                           tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    return ModelBundle(hf.GPT2LMHeadModel(config), _tokens(vocab, seq_len), _next_token_loss)


@factory
def bert(vocab: int = 2048, seq_len: int = 64, hidden: int = 256, heads: int = 4, layers: int = 4,
         intermediate: int | None = None, classes: int = 2, dropout: float = 0.0) -> ModelBundle:
    """BERT (`BertForSequenceClassification`) on token sequences of `seq_len`, `classes` labels."""
    hf = _transformers()
    config = hf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=intermediate or 4 * hidden, max_position_embeddings=seq_len,
                           num_labels=classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)

    def make_batch(batch_size: int):
        return torch.randint(0, vocab, (batch_size, seq_len)), torch.randint(0, classes, (batch_size,))

    return ModelBundle(hf.BertForSequenceClassification(config), make_batch, _classification_loss)


@factory
def llama(vocab: int = 2048, seq_len: int = 64, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
          layers: int = 4, intermediate: int | None = None) -> ModelBundle:
    """Llama (`LlamaForCausalLM`: RoPE, RMSNorm, SwiGLU, grouped-query attention with
    `kv_heads` key/value heads) on token sequences of `seq_len`."""
    hf = _transformers()
    config = hf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, intermediate_size=intermediate or 2 * hidden + hidden // 2,
                            max_position_embeddings=seq_len, use_cache=False, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0)
    return ModelBundle(hf.LlamaForCausalLM(config), _tokens(vocab, seq_len), _next_token_loss)
