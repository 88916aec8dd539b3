"""Reference checks on causal language models of many Hugging Face architectures (issue 18: "checked with cases and
models that are not in this repository").

Each model is built from its config with random weights (`AutoConfig.for_model`, nothing downloaded), two layers,
hidden 64, vocabulary 128, in train mode (the dropout of GPT-2, GPT-J, OPT, BLOOM, Phi, StarCoder2... is active),
and trains three SGD steps under tapesac and without it: loss, every gradient, the parameters after each optimizer
step and the RNG state are bitwise equal (`conftest.reference_check`). Blocks are the model's list of decoder layers.
- `test_full`: `policy="full"` (every saved tensor of a layer dropped and rebuilt by replay).
- `test_full_variants`: `full` on the emulated graph backend, in bf16 autocast, and an op set keeping the matrix
  products and attention (the rest dropped).
- `test_auto`: `policy="auto"` at a limit 30% of the way from `full`'s measured peak to `none`'s, so the plans drop
  part of what the layers save; every step must drop something.
The architectures cover the attention and MLP variants in use (GQA, MQA, parallel attention/MLP blocks, partial
rotary, sliding windows, QK norms, MLA), mixtures of experts (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3, GPT-OSS, Jamba,
Qwen3-Next), and state-space / convolution mixers (Mamba, Mamba2, LFM2, Qwen3-Next's linear attention) on their
reference (non-kernel) paths.
- `test_other_tasks`: encoder-decoders (T5, BART, mBART, Pegasus: encoder and decoder layers are blocks), encoders
  with padding masks (BERT, RoBERTa, DeBERTa-v2, ELECTRA, DistilBERT, ModernBERT, ALBERT: one shared layer called
  twice) and vision models (ViT, DINOv2, Swin, ConvNeXt with drop path, ResNet with BatchNorm), under `full` on the
  eager and the emulated graph backends.
An architecture the installed transformers does not know is skipped, naming the
version; any other error fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import limit_between_full_and_none, reference_check

pytestmark = pytest.mark.usefixtures("one_thread")

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)

# model_type -> config overrides (on top of _COMMON). Dropout is set where the architecture has it.
ARCHS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_ctx=64, n_positions=64),
    "gpt_neox": dict(num_key_value_heads=4, hidden_dropout=0.1, attention_dropout=0.1),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, dropout=0.1, attention_dropout=0.1),
    "bloom": dict(n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1),
    "falcon": dict(num_kv_heads=4, new_decoder_architecture=True, hidden_dropout=0.1),
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2),
    "xglm": dict(d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, dropout=0.1),
    "phi": dict(num_key_value_heads=4, resid_pdrop=0.1, embd_pdrop=0.1),
    "phi3": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=16),
    "starcoder2": dict(num_key_value_heads=2, residual_dropout=0.1, attention_dropout=0.1, embedding_dropout=0.1),
    "stablelm": dict(num_key_value_heads=2, hidden_dropout=0.1),
    "olmo2": dict(num_key_value_heads=2),
    "granite": dict(num_key_value_heads=2),
    "cohere": dict(num_key_value_heads=2),
    "glm4": dict(num_key_value_heads=2),
    "smollm3": dict(num_key_value_heads=2),
    "gemma2": dict(num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16, sliding_window=16),
    "nemotron": dict(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5),
    "bitnet": dict(num_key_value_heads=2),
    "exaone4": dict(num_key_value_heads=2),
    "hunyuan_v1_dense": dict(num_key_value_heads=2, head_dim=16),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "olmoe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "gpt_oss": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    "mamba2": dict(state_size=8, expand=2, conv_kernel=4, num_heads=8, head_dim=16, n_groups=1, chunk_size=16),
    "jamba": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8,
                  use_mamba_kernels=False),
    "lfm2": dict(num_key_value_heads=2, layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       layer_types=["linear_attention", "full_attention"]),
}
# Jamba's step peak does not depend on what its layers keep at this size (full and none peak alike): no limit
# between them to plan under.
AUTO_ARCHS = [a for a in ARCHS if a != "jamba"]
BATCH, SEQ = 2, 48


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if arch not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {arch!r}")
    return AutoConfig.for_model(arch, **overrides)


def make_model(arch: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(_config(arch, {**_COMMON, **ARCHS[arch]})).float()


def layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the ModuleList of num_hidden_layers modules with the shortest name."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == 2
             and any(p.numel() for p in m.parameters())]
    assert lists, f"{type(model).__name__}: no ModuleList of 2 layers"
    return min(lists, key=lambda nm: len(nm[0]))[1]


def inputs() -> torch.Tensor:
    return torch.randint(3, 128, (BATCH, SEQ))  # [batch, seq] token ids (0-2: pad, bos, eos)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_full(arch: str) -> None:
    reference_check(lambda: make_model(arch), inputs, "full", layers, loss_fn, steps=3, optimizer=sgd,
                    block_calls=2)


# What an op-set policy keeps: the products and attention; everything else a layer saves is dropped.
KEEP_PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                           "aten::_scaled_dot_product_flash_attention_for_cpu"})


def bf16_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_fn(model, ids)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("variant", ["emulated_graph", "autocast_bf16", "op_set"])
def test_full_variants(arch: str, variant: str) -> None:
    policy, loss, kwargs = "full", loss_fn, {}
    if variant == "emulated_graph":
        kwargs = {"backend": "emulated_graph"}
    elif variant == "autocast_bf16":
        loss = bf16_loss
    else:
        policy = KEEP_PRODUCTS
    reference_check(lambda: make_model(arch), inputs, policy, layers, loss, steps=2, optimizer=sgd, block_calls=2,
                    sac_kwargs=kwargs)


@pytest.mark.parametrize("arch", AUTO_ARCHS)
def test_auto(arch: str) -> None:
    limit = limit_between_full_and_none(lambda: make_model(arch), layers, loss_fn, inputs, 0.3)
    res = reference_check(lambda: make_model(arch), inputs, "auto", layers, loss_fn, steps=3, optimizer=sgd,
                          block_calls=2, sac_kwargs={"memory_limit": limit})
    planned = res.all_stats[1:]  # the first step measures
    assert all(s.dropped_tensors < s.saved_tensors for s in planned), (
        f"{arch}: a planned step dropped every saved tensor at a limit above full's peak: "
        f"{[(s.dropped_tensors, s.saved_tensors) for s in planned]}")


# Other tasks: model_type -> (Auto class name, config overrides, task).
_TEXT = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
_ENC = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)
_S2S = dict(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, dropout=0.1, max_position_embeddings=64)
OTHER: dict[str, tuple[str, dict[str, Any], str]] = {
    "t5": ("AutoModelForSeq2SeqLM", dict(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                         d_kv=16, dropout_rate=0.1), "seq2seq"),
    "bart": ("AutoModelForSeq2SeqLM", _S2S, "seq2seq"),
    "mbart": ("AutoModelForSeq2SeqLM", _S2S, "seq2seq"),
    "pegasus": ("AutoModelForSeq2SeqLM", _S2S, "seq2seq"),
    "bert": ("AutoModelForSequenceClassification", _ENC, "classify"),
    "roberta": ("AutoModelForSequenceClassification", _ENC, "classify"),
    "deberta-v2": ("AutoModelForSequenceClassification", _ENC, "classify"),
    "distilbert": ("AutoModelForSequenceClassification",
                   dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64), "classify"),
    "electra": ("AutoModelForMaskedLM", dict(_ENC, embedding_size=64), "masked"),
    "modernbert": ("AutoModelForMaskedLM", _ENC, "masked"),
    "albert": ("AutoModelForMaskedLM", dict(_ENC, embedding_size=32), "masked"),
    "vit": ("AutoModelForImageClassification", dict(_ENC, image_size=32, patch_size=8, num_labels=2,
                                                    hidden_dropout_prob=0.1), "image"),
    "dinov2": ("AutoModelForImageClassification", dict(_ENC, image_size=32, patch_size=8, num_labels=2), "image"),
    "swin": ("AutoModelForImageClassification", dict(embed_dim=16, depths=[2, 2], num_heads=[2, 4], image_size=32,
                                                     patch_size=4, window_size=4, num_labels=2, drop_path_rate=0.1),
             "image"),
    "convnext": ("AutoModelForImageClassification", dict(hidden_sizes=[16, 32], depths=[2, 2], num_stages=2,
                                                         image_size=32, num_labels=2, drop_path_rate=0.1), "image"),
    "resnet": ("AutoModelForImageClassification", dict(hidden_sizes=[16, 32], depths=[2, 2], embedding_size=16,
                                                       num_labels=2), "image"),
}


def make_other(arch: str) -> nn.Module:
    import transformers

    auto_name, overrides, task = OTHER[arch]
    config = _config(arch, {**(_TEXT if task != "image" else {}), **overrides})
    return getattr(transformers, auto_name).from_config(config).float()


def other_blocks(model: nn.Module) -> list[nn.Module]:
    """ALBERT: its one shared layer (called twice per step); otherwise every module of the outermost ModuleLists of
    two or more modules with parameters (an encoder-decoder's encoder and decoder layers, a vision model's stages)."""
    albert = [m for m in model.modules() if type(m).__name__ == "AlbertLayer"]
    if albert:
        return albert
    lists: list[tuple[str, nn.ModuleList]] = []
    for name, m in model.named_modules():
        if (isinstance(m, nn.ModuleList) and len(m) >= 2 and all(any(p.numel() for p in c.parameters()) for c in m)
                and not any(name.startswith(outer + ".") for outer, _ in lists)):
            lists.append((name, m))
    assert lists, f"{type(model).__name__}: no list of layers"
    return [b for _, blocks in lists for b in blocks]


def other_inputs(task: str) -> Any:
    def make() -> dict[str, torch.Tensor]:
        if task == "image":
            return {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.tensor([0, 1])}
        ids = torch.randint(3, 128, (BATCH, 24))  # [batch, seq]
        mask = torch.ones_like(ids)
        mask[0, -5:] = 0  # the first sequence padded
        if task == "seq2seq":
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(3, 128, (BATCH, 12))}
        if task == "classify":
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return make


def kwargs_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@pytest.mark.parametrize("arch", list(OTHER))
@pytest.mark.parametrize("backend", ["eager", "emulated_graph"])
def test_other_tasks(arch: str, backend: str) -> None:
    reference_check(lambda: make_other(arch), other_inputs(OTHER[arch][2]), "full", other_blocks, kwargs_loss,
                    steps=2, optimizer=sgd, sac_kwargs={"backend": backend})
