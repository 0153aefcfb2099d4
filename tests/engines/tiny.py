"""Tiny random Llama-family models and a word-level tokenizer, built in-process."""

from __future__ import annotations

import torch

from engines.llama import LlamaConfig, LlamaModel, LlamaWeights
from engines.loading import LoadedModel

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)] + ["hello", "world", "stop", "the", "cat", "sat"]


def tiny_tokenizer(words=WORDS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny_hf_model(vocab=len(WORDS), layers=4, hidden=32, heads=4, kv_heads=2, seed=0,
                  model_type="llama", dtype=torch.float64, scale=1.0):
    """A random HF causal LM. `scale` sharpens the output distribution (bigger
    logits), which makes drafts agree with the target more often."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
              eos_token_id=1, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(HFLlamaConfig(**kw))
    model = model.to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        if model_type == "qwen2":  # random biases so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def lean_from_hf(hf_model, dtype=torch.float64) -> LlamaModel:
    cfg = LlamaConfig.from_hf(hf_model.config)
    weights = LlamaWeights.from_state_dict(cfg, hf_model.state_dict(), hf_model.config, dtype, "cpu")
    return LlamaModel(cfg, weights)


def tiny_loaded(seed=0, scale=1.0, **kw) -> LoadedModel:
    hf = tiny_hf_model(seed=seed, scale=scale, **kw)
    return LoadedModel(lean_from_hf(hf), tiny_tokenizer(), hf.config, "tiny")
