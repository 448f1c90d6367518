"""Hugging Face `transformers` models, built from configs with random weights (nothing downloaded).

Use them as `pd profile --model pdtool.zoo.hf:gpt2 -a n_layer=4 ...` after `pip install -e
'.[hf]'`. torch.fx cannot trace these models; pdtool captures them with torch.export, and
`pd train` splits that graph. Every factory returns a `ModelBundle` whose batches are random
token sequences; the defaults are small enough for a laptop, the published sizes a few
keyword arguments away (GPT-2 small: `n_embd=768 n_head=12 n_layer=12 vocab=50257`).

- `gpt2`: `GPT2LMHeadModel`, next-token loss; its output head is tied to the token embedding.
- `bert`: `BertForSequenceClassification`, cross entropy over `classes` labels.
- `llama`: `LlamaForCausalLM` (RoPE, RMSNorm, SwiGLU, grouped-query attention), next-token loss.
- `t5`: `T5ForConditionalGeneration`, an encoder-decoder whose batches are dicts of keyword inputs
  (`input_ids`, `labels`) from which the model computes its own loss: no loss function, no wrapper.
- `gpt2(labels=True)`: the same for GPT-2 (`input_ids` and `labels`, the model's own loss).
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


def _labelled(vocab: int, seq_len: int):
    """Batches as Hugging Face models take them: keyword inputs, the labels among them."""
    def make_batch(batch_size: int):
        tokens = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": tokens, "labels": tokens}
    return make_batch


@factory
def gpt2(vocab: int = 2048, seq_len: int = 64, n_embd: int = 256, n_head: int = 4, n_layer: int = 4,
         dropout: float = 0.0, tie: bool = True, labels: bool = False) -> ModelBundle:
    """GPT-2 (`GPT2LMHeadModel`) on token sequences of `seq_len`; `tie` ties the output head to
    the token embedding, as GPT-2 does. `labels`: batches are `{"input_ids", "labels"}` and the
    model computes its own (shifted) next-token loss, instead of (tokens, next tokens) and
    pdtool's loss function."""
    hf = _transformers()
    config = hf.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                           resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                           tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    if labels:
        return ModelBundle(module=hf.GPT2LMHeadModel(config), make_batch=_labelled(vocab, seq_len))
    return ModelBundle(module=hf.GPT2LMHeadModel(config), make_batch=_tokens(vocab, seq_len), loss_fn=_next_token_loss)


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

    return ModelBundle(
        module=hf.BertForSequenceClassification(config), make_batch=make_batch, loss_fn=_classification_loss
    )


@factory
def llama(vocab: int = 2048, seq_len: int = 64, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
          layers: int = 4, intermediate: int | None = None, labels: bool = False) -> ModelBundle:
    """Llama (`LlamaForCausalLM`: RoPE, RMSNorm, SwiGLU, grouped-query attention with
    `kv_heads` key/value heads) on token sequences of `seq_len`; `labels` as for `gpt2`."""
    hf = _transformers()
    config = hf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, intermediate_size=intermediate or 2 * hidden + hidden // 2,
                            max_position_embeddings=seq_len, use_cache=False, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0)
    if labels:
        return ModelBundle(module=hf.LlamaForCausalLM(config), make_batch=_labelled(vocab, seq_len))
    return ModelBundle(module=hf.LlamaForCausalLM(config), make_batch=_tokens(vocab, seq_len), loss_fn=_next_token_loss)


@factory
def t5(vocab: int = 2048, seq_len: int = 64, d_model: int = 256, heads: int = 4, layers: int = 2,
       d_ff: int | None = None, d_kv: int | None = None) -> ModelBundle:
    """T5 (`T5ForConditionalGeneration`): `layers` encoder and `layers` decoder blocks on token
    sequences of `seq_len`, batches `{"input_ids", "labels"}` (the decoder's inputs are the
    labels shifted right, inside the model, which also computes the loss)."""
    hf = _transformers()
    config = hf.T5Config(vocab_size=vocab, d_model=d_model, num_heads=heads, num_layers=layers,
                         num_decoder_layers=layers, d_ff=d_ff or 4 * d_model, d_kv=d_kv or d_model // heads,
                         dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                         eos_token_id=1)
    return ModelBundle(module=hf.T5ForConditionalGeneration(config), make_batch=_labelled(vocab, seq_len))


@factory
def mixtral(vocab: int = 2048, seq_len: int = 64, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
            layers: int = 4, experts: int = 4, per_token: int = 2, intermediate: int | None = None) -> ModelBundle:
    """Mixtral (`MixtralForCausalLM`): a mixture of `experts` SwiGLU experts per block, each token
    routed to `per_token` of them, next-token loss (the router's auxiliary loss left out)."""
    hf = _transformers()
    config = hf.MixtralConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv_heads,
                              intermediate_size=intermediate or 2 * hidden, num_local_experts=experts,
                              num_experts_per_tok=per_token, max_position_embeddings=seq_len, use_cache=False,
                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return ModelBundle(
        module=hf.MixtralForCausalLM(config), make_batch=_tokens(vocab, seq_len), loss_fn=_next_token_loss
    )


@factory
def mamba(vocab: int = 2048, seq_len: int = 64, hidden: int = 256, layers: int = 4, state: int = 16) -> ModelBundle:
    """Mamba (`MambaForCausalLM`, a selective state-space model: no attention), next-token loss;
    on the CPU its scan is transformers' sequential reference implementation."""
    hf = _transformers()
    config = hf.MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, state_size=state,
                            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                            tie_word_embeddings=False)
    return ModelBundle(module=hf.MambaForCausalLM(config), make_batch=_tokens(vocab, seq_len), loss_fn=_next_token_loss)


@factory
def vit(image_size: int = 64, patch: int = 8, hidden: int = 256, heads: int = 4, layers: int = 4,
        classes: int = 10) -> ModelBundle:
    """Vision transformer (`ViTForImageClassification`) on `image_size` RGB images cut into
    `patch`-pixel patches, cross entropy over `classes` labels."""
    hf = _transformers()
    config = hf.ViTConfig(image_size=image_size, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, intermediate_size=4 * hidden, num_labels=classes)

    def make_batch(batch_size: int):
        return torch.randn(batch_size, 3, image_size, image_size), torch.randint(0, classes, (batch_size,))

    return ModelBundle(module=hf.ViTForImageClassification(config), make_batch=make_batch, loss_fn=_classification_loss)
