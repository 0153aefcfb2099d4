"""A tiny random Llama-family model with a word-level tokenizer, written as an
HF directory: what fault drills and tests run engine workers on (seconds to
load, no model hub, no real weights)."""

from __future__ import annotations

from pathlib import Path

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)] + ["hello", "world", "stop", "the", "cat", "sat"]


def tiny_tokenizer(words=WORDS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny_hf_model(vocab=len(WORDS), layers=4, hidden=32, heads=4, kv_heads=2, seed=0, model_type="llama",
                  dtype=None, scale=1.0, max_positions=256):
    """A random HF causal LM. `scale` sharpens the output distribution (bigger
    logits), which makes drafts agree with the target more often."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
              eos_token_id=1, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(Qwen2Config(**kw)) if model_type == "qwen2" else LlamaForCausalLM(HFLlamaConfig(**kw))
    model = model.to(dtype or torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        if model_type == "qwen2":  # random biases so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def write_tiny_engine(directory: Path, max_context: int = 96, hidden: int = 32, layers: int = 4) -> Path:
    """The model as an HF directory and an engine config YAML naming it; returns the YAML's path."""
    import torch
    import yaml

    model = tiny_hf_model(scale=4.0, dtype=torch.float32, hidden=hidden, layers=layers,
                          max_positions=max(256, max_context))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar for a 1 MB file is noise in every log
    model.save_pretrained(directory / "model")
    tiny_tokenizer().save_pretrained(directory / "model")
    cfg = directory / "engine.yaml"
    # its own cache: the start-up profiles of processes serving it stay beside it, out of the user's
    cfg.write_text(yaml.safe_dump({"target": {"path": str(directory / "model"), "max_context": max_context,
                                              "cache_dir": str(directory / "cache")},
                                   "drafts": [{"kind": "ngram", "name": "ngram"}], "gamma_max": 4}))
    return cfg
