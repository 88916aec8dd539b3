# tapesac.models — tiny Hugging Face decoder models built from configs, for the demo, tests and benchmarks.
#
# Contract:
# - Every builder returns a freshly initialised `XxxForCausalLM` with random weights; nothing is downloaded
#   (never `from_pretrained`). transformers is imported lazily inside the builders, after the builders have
#   set HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1 (setdefault: an explicit user value wins), so importing
#   this module costs nothing and reads no environment.
# - Configs follow reference/peers.md §5.1: `use_cache=False`, `attn_implementation="sdpa"`,
#   `tie_word_embeddings=True`, vocabulary defaulting to the byte tokenizer of tapesac.data (259 ids, with
#   BOS/EOS/PAD = 256/257/258). Extra keyword arguments go to the config unchanged (5.x configs are strict:
#   an unknown name raises there).
# - `seed` (optional) makes the initial weights deterministic without touching the caller's global RNG
#   (construction runs inside `torch.random.fork_rng`).
# - The decoder layers live at `model.model.layers`, so `blocks="model.layers.*"` selects them.
# - Sizes (batch 8 x seq 128, one AdamW step without tapesac, 2 Xeon cores, torch 2.14.1, transformers 5.24):
#   tiny_qwen3() = H128 L4 I384, 0.82 M params, ~90 ms; the demo's H192 L4 (6 heads, 2 kv) is 1.77 M params,
#   ~105-185 ms depending on machine load.
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

__all__ = ["BYTE_VOCAB_SIZE", "tiny_llama", "tiny_qwen3", "tiny_qwen3_moe", "param_count"]

# 256 byte values + BOS/EOS/PAD; kept equal to tapesac.data.ByteTokenizer.vocab_size (not imported to keep
# this module free of the data module).
BYTE_VOCAB_SIZE = 259
_BOS_ID, _EOS_ID, _PAD_ID = 256, 257, 258


def _transformers():
    """Import transformers offline (called by the builders only, never at module import)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    return transformers


def _token_ids(vocab_size: int) -> dict[str, int | None]:
    """BOS/EOS/PAD ids of the byte tokenizer when they fit in the vocabulary, else None."""
    if vocab_size >= BYTE_VOCAB_SIZE:
        return dict(bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID)
    return dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _check_heads(hidden_size: int, num_attention_heads: int, num_key_value_heads: int) -> None:
    if hidden_size <= 0 or num_attention_heads <= 0 or num_key_value_heads <= 0:
        raise ValueError(
            f"hidden_size, num_attention_heads and num_key_value_heads must be > 0, got {hidden_size}, "
            f"{num_attention_heads}, {num_key_value_heads}"
        )
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({num_key_value_heads}); pick e.g. num_key_value_heads={num_attention_heads // 2 or 1}"
        )


def _decoder_kwargs(
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    max_position_embeddings: int,
    attention_dropout: float,
    attn_implementation: str,
    config_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The config fields every tiny decoder here shares (tied embeddings, no KV cache, no special tokens)."""
    _check_heads(hidden_size, num_attention_heads, num_key_value_heads)
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=attention_dropout,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation=attn_implementation,
        **{**_token_ids(vocab_size), **config_kwargs},
    )


def _build(model_cls: Callable[[Any], Any], config: Any, seed: int | None) -> Any:
    import torch

    if seed is None:
        model = model_cls(config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
    model.train()
    return model


def tiny_qwen3(
    vocab_size: int = BYTE_VOCAB_SIZE,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    attention_dropout: float = 0.0,
    attn_implementation: str = "sdpa",
    seed: int | None = None,
    **config_kwargs: Any,
) -> "Qwen3ForCausalLM":
    """A tiny Qwen3 decoder (per-head q/k RMSNorm, GQA, SwiGLU MLP) with random weights.

    Args:
        vocab_size: vocabulary size; the default fits tapesac.data.ByteTokenizer (259).
        hidden_size: model width H.
        num_hidden_layers: number of decoder layers (the checkpointed blocks, `model.layers.*`).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); must divide num_attention_heads.
        head_dim: per-head width; default hidden_size // num_attention_heads.
        intermediate_size: MLP width; default 3 * hidden_size.
        max_position_embeddings: longest sequence the rotary table covers.
        attention_dropout: > 0 makes attention random (exercises RNG replay).
        attn_implementation: "sdpa" (default) or "eager".
        seed: if set, weights are initialised from this seed without changing the global RNG.
        **config_kwargs: passed to Qwen3Config unchanged.
    """
    tf = _transformers()
    config = tf.Qwen3Config(
        intermediate_size=intermediate_size if intermediate_size is not None else 3 * hidden_size,
        head_dim=head_dim if head_dim is not None else hidden_size // num_attention_heads,
        **_decoder_kwargs(
            vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            max_position_embeddings, attention_dropout, attn_implementation, config_kwargs,
        ),
    )
    return _build(tf.Qwen3ForCausalLM, config, seed)


def tiny_llama(
    vocab_size: int = BYTE_VOCAB_SIZE,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    attention_dropout: float = 0.0,
    attn_implementation: str = "sdpa",
    seed: int | None = None,
    **config_kwargs: Any,
) -> "LlamaForCausalLM":
    """A tiny Llama decoder (GQA, SwiGLU MLP, no q/k norm) with random weights.

    Args: as tiny_qwen3; intermediate_size defaults to round(8/3 * hidden_size) rounded up to a multiple
    of 8 (the Llama ratio; 344 for H128, 688 for H256 as in peers.md §5.1).
    """
    tf = _transformers()
    if intermediate_size is None:
        intermediate_size = -(-round(8 * hidden_size / 3) // 8) * 8
    config = tf.LlamaConfig(
        intermediate_size=intermediate_size,
        head_dim=head_dim if head_dim is not None else hidden_size // num_attention_heads,
        **_decoder_kwargs(
            vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            max_position_embeddings, attention_dropout, attn_implementation, config_kwargs,
        ),
    )
    return _build(tf.LlamaForCausalLM, config, seed)


def tiny_qwen3_moe(
    vocab_size: int = BYTE_VOCAB_SIZE,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    moe_intermediate_size: int | None = None,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    norm_topk_prob: bool = True,
    max_position_embeddings: int = 1024,
    attention_dropout: float = 0.0,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
    seed: int | None = None,
    **config_kwargs: Any,
) -> "Qwen3MoeForCausalLM":
    """A tiny Qwen3-MoE decoder (top-k routed experts in every layer) with random weights.

    Routing is data dependent, so the op sequence of a layer changes from step to step: the case that
    makes tapesac record tapes every step.

    Args: as tiny_qwen3, plus
        moe_intermediate_size: per-expert MLP width; default hidden_size (peers.md: 256 at H256).
        num_experts / num_experts_per_tok / norm_topk_prob: the router.
        intermediate_size: dense MLP width (used only by layers in `mlp_only_layers`); default 3 * H.
        experts_implementation: sets `config._experts_implementation` ("eager" = loop plus index_add_,
            "batched_mm", "grouped_mm"); None keeps the transformers default.
    """
    if not 0 < num_experts_per_tok <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be in 1..num_experts ({num_experts}), got {num_experts_per_tok}"
        )
    tf = _transformers()
    config = tf.Qwen3MoeConfig(
        intermediate_size=intermediate_size if intermediate_size is not None else 3 * hidden_size,
        moe_intermediate_size=moe_intermediate_size if moe_intermediate_size is not None else hidden_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        **_decoder_kwargs(
            vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            max_position_embeddings, attention_dropout, attn_implementation, config_kwargs,
        ),
    )
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return _build(tf.Qwen3MoeForCausalLM, config, seed)


def param_count(model: "torch.nn.Module") -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
