"""Drafts from config: one proposer factory per configured draft.

A factory takes the KV capacity a request reserved and returns a fresh proposer
for that request (a model draft keeps a KV cache of its own per request).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engines.config import EngineConfig, LayerDraftConfig, ModelDraftConfig, NgramDraftConfig, TargetConfig
from engines.llama import LlamaModel, pack_for_cpu
from engines.loading import LoadedModel, check_tokenizers_match, load_model
from engines.proposers import ModelDraftProposer, NgramProposer, Proposer

ProposerFactory = Callable[[int], Proposer]  # KV capacity -> a fresh proposer for one request


def should_pack(t: TargetConfig) -> bool:
    """oneDNN weight packing applies to float32 on CPU only."""
    return t.pack_weights and t.device == "cpu" and t.dtype == "float32" and torch.backends.mkldnn.is_available()


def build_drafts(config: EngineConfig, target: LoadedModel, cache_dir: Path) -> dict[str, ProposerFactory]:
    """Refuses a draft whose tokenizer differs from the target's."""
    t = config.target
    drafts: dict[str, ProposerFactory] = {}
    for d in config.drafts:
        if isinstance(d, NgramDraftConfig):
            drafts[d.name] = (lambda cap, d=d: NgramProposer(d.min_n, d.max_n, t.device))
        elif isinstance(d, LayerDraftConfig):
            sub = LlamaModel(target.model.cfg, target.model.weights, d.layer_ids(target.model.cfg.num_layers))
            drafts[d.name] = (lambda cap, sub=sub: ModelDraftProposer(sub, cap))
        elif isinstance(d, ModelDraftConfig):
            loaded = load_model(d.path, getattr(torch, t.dtype), t.device, cache_dir)
            check_tokenizers_match(target.tokenizer, loaded.tokenizer, d.name)
            if should_pack(t):
                pack_for_cpu(loaded.model.weights)
            drafts[d.name] = (lambda cap, m=loaded.model: ModelDraftProposer(m, cap))
    return drafts
