"""Drafts from config: one proposer factory per configured draft.

A factory takes the KV capacity a request reserved and returns a fresh proposer
for that request (a model draft keeps a KV cache of its own per request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.config import (
    EagleDraftConfig,
    EngineConfig,
    HybridDraftConfig,
    LayerDraftConfig,
    ModelDraftConfig,
    NgramDraftConfig,
    TargetConfig,
)
from engines.layouts import route_columns
from engines.llama import LlamaModel, LlamaWeights
from engines.loading import LoadedModel, check_tokenizers_match, fingerprint, load_model
from engines.proposers import (
    EagleDraft,
    EagleProposer,
    HybridProposer,
    ModelDraftProposer,
    NgramProposer,
    Proposer,
)
from engines.proposers.eagle import load_draft

log = logging.getLogger(__name__)

ProposerFactory = Callable[[int], Proposer]  # KV capacity -> a fresh proposer for one request
SHIPPED = Path(__file__).resolve().parent / "data" / "eagle-smollm2-135m-instruct"


@dataclass
class Drafts:
    factories: dict[str, ProposerFactory]
    weights: list[LlamaWeights] = field(default_factory=list)  # laid out like the target's (CPU packing)
    eagles: list[EagleDraft] = field(default_factory=list)
    models: list[LlamaModel] = field(default_factory=list)  # every draft's decoder (their attention's kernel)

    def route_columns(self, layers: int, head: int, panels: bool = False) -> None:
        """Route the drafts' own matmuls as the start-up profile routed the target's
        (layouts.route_columns): the same kernels, on weights as cold in cache
        between two target forwards. Drafts sharing the target's weights are
        routed with them."""
        for w in self.weights:
            route_columns(w, layers, head, panels)
        for e in self.eagles:
            e.route_inputs(layers, panels)


def _hybrid(d: HybridDraftConfig, lookup: NgramDraftConfig, model: ProposerFactory, device: str) -> ProposerFactory:
    key = object()  # one batch key per hybrid draft: its rows' model drafts run together

    def factory(capacity: int) -> HybridProposer:
        n = max(lookup.min_n, d.min_match)
        return HybridProposer(NgramProposer(n, max(lookup.max_n, n), device), model(capacity), (d.lookup, d.model),
                              key)
    return factory


def may_pack(t: TargetConfig) -> bool:
    """Weight packing (oneDNN, MKL-packed copies) applies to float32 on CPU only."""
    return (t.pack_weights is not False and t.device == "cpu" and t.dtype == "float32"
            and torch.backends.mkldnn.is_available())


def build_drafts(config: EngineConfig, target: LoadedModel, cache_dir: Path) -> Drafts:
    """Refuses a draft whose tokenizer differs from the target's, and a trained
    draft made for another target."""
    t = config.target
    out = Drafts({})
    target_print = None
    for d in config.drafts:
        if isinstance(d, NgramDraftConfig):
            out.factories[d.name] = (lambda cap, d=d: NgramProposer(d.min_n, d.max_n, t.device))
        elif isinstance(d, LayerDraftConfig):
            sub = LlamaModel(target.model.cfg, target.model.weights, d.layer_ids(target.model.cfg.num_layers))
            out.models.append(sub)
            out.factories[d.name] = (lambda cap, sub=sub: ModelDraftProposer(sub, cap))
        elif isinstance(d, ModelDraftConfig):
            loaded = load_model(d.path, getattr(torch, t.dtype), t.device, cache_dir)
            check_tokenizers_match(target.tokenizer, loaded.tokenizer, d.name)
            out.weights.append(loaded.model.weights)
            out.models.append(loaded.model)
            out.factories[d.name] = (lambda cap, m=loaded.model: ModelDraftProposer(m, cap))
        elif isinstance(d, EagleDraftConfig):
            if d.path is None and t.path is not None:
                raise ValueError(f"draft {d.name!r}: no draft ships for target {t.path}; train one with "
                                 f"`specgate distill` and give its directory as path")
            target_print = target_print or fingerprint(target)
            tensors, vocab_ids, card = load_draft(d.path or SHIPPED, target_print, d.weights)
            eagle = EagleDraft(target.model, tensors, vocab_ids, tuple(card.get("feature_layers", (-1,))), d.name,
                               card.get("training", {}).get("seq_len"))
            if out.eagles and out.eagles[0].feature_layers != eagle.feature_layers:
                raise ValueError(f"draft {d.name!r} reads target layers {eagle.feature_layers}, another draft "
                                 f"{out.eagles[0].feature_layers}: one engine serves drafts reading the same layers")
            measured = {k: v["acceptance"] for k, v in card.get("validation", {}).items()
                        if isinstance(v, dict) and "acceptance" in v}
            window = f" on windows of {eagle.context} positions (the most of a prompt it reads)" if eagle.context \
                else ""
            log.info("draft %s: %d-token head, trained %s%s, weights %s; validation acceptance per drafted token "
                     "%s", d.name, vocab_ids.numel(), card.get("created", "?"), window, d.weights,
                     " ".join(f"{k} {v}" for k, v in measured.items()) or "not recorded")
            out.eagles.append(eagle)
            out.weights.append(eagle.model.weights)
            out.models.append(eagle.model)
            out.factories[d.name] = (lambda cap, e=eagle, d=d: EagleProposer(e, cap, d.min_confidence))
    for d in config.drafts:  # after the drafts they name
        if isinstance(d, HybridDraftConfig):
            out.factories[d.name] = _hybrid(d, next(x for x in config.drafts if x.name == d.lookup),
                                            out.factories[d.model], t.device)
    return out
