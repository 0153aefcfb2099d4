"""Drafting with a trained EAGLE-style head (engines/distill/): one decoder layer
that reads the target's own hidden states (from a low, a middle and the last
layer, as EAGLE-3 does), so the draft starts from what the target already
computed, and a head over the tokens the target writes most
(the rows of the target's own LM head for them).

Per request the draft keeps its layer's KV cache over the positions the target
has processed. Before each proposal it feeds the positions the target
committed since (their true hidden states, handed over by the scheduler), then
drafts token by token on its own predicted states. Of a prompt longer than the
windows the draft was trained on (`context`, its card's seq_len) it reads only
the last `context` positions: it never learned to attend further back, and the
target's states it reads already carry the rest (RoPE attention sees relative
positions only, so its cache simply starts there). Drafting stops early when
the draft's running confidence falls below the request's threshold. Requests
sharing the draft draft together: one batched forward per draft position.

The draft's q is zero outside its vocabulary; the rejection sampler's residual
handles that, so output stays exactly the target's distribution.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engines.api import SamplingParams
from engines.layouts import dense, linear, route_matmul
from engines.llama import LayerWeights, LlamaModel, LlamaWeights
from engines.panels import round_to
from engines.proposers.base import DraftingClock, Proposal, ProposerBase, empty
from engines.sampling import DraftPicks, argmax, logits_to_probs

TENSORS = ("norm_levels", "reduce", "norm_e", "norm_f", "fc", "attn_norm", "qkv", "o", "mlp_norm", "gate_up",
           "down")
MATMULS = ("reduce", "fc", "qkv", "o", "gate_up", "down")  # its own matmuls' weights (the head is the target's)


class EagleDraft:
    """The trained head at inference, shared by every request drafting with it."""

    def __init__(self, target: LlamaModel, tensors: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
                 feature_layers: tuple[int, ...] = (-1,), name: str = "eagle", context: int | None = None):
        tw, dtype, device = target.weights, target.dtype, target.device
        t = {k: tensors[k].to(device=device, dtype=dtype).contiguous() for k in TENSORS}
        self.name = name
        self.vocab_ids = vocab_ids.to(device=device, dtype=torch.long)
        head = dense(tw.lm_head)
        layer = LayerWeights(t["attn_norm"], t["qkv"], None, t["o"], t["mlp_norm"], t["gate_up"], t["down"])
        weights = LlamaWeights(tw.embed, [layer], tw.norm, head[self.vocab_ids].contiguous(), tw.inv_freq,
                               tw.rope_scale)
        cfg = dataclasses.replace(target.cfg, num_layers=1, vocab_size=int(self.vocab_ids.numel()))
        self.model = LlamaModel(cfg, weights)
        self.embed, self.eps, self.E = tw.embed, cfg.rms_norm_eps, cfg.hidden_size
        self.norm_e, self.norm_f, self.fc = t["norm_e"], t["norm_f"], t["fc"]
        self.norm_levels, self.reduce = t["norm_levels"], t["reduce"]
        self.feature_layers = tuple(feature_layers)  # the target layers whose states it reads
        self.vocab_size = target.cfg.vocab_size
        self.context = context  # the most prompt positions it reads (None: all)

    def route_inputs(self, upto: int, panels: bool = False) -> None:
        """Run the two matmuls before its layer (fc, reduce) as W @ xᵀ for forwards
        of up to `upto` rows, as its layer's (Drafts.route_columns routes those)."""
        self.fc = route_matmul(self.fc, upto, panels=panels)
        self.reduce = route_matmul(self.reduce, upto, panels=panels)

    def reduced(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states [T, levels · E] -> one vector [T, E]."""
        T = states.shape[0]
        f = states.to(self.embed.dtype).view(T, -1, self.E)
        f = F.rms_norm(f, (self.E,), eps=self.eps) * self.norm_levels
        return linear(f.reshape(T, -1), self.reduce)

    def inputs(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """tokens [T] (the token after each position), g [T, E] (reduced target
        states, or the draft's own outputs) -> layer inputs [T, E]."""
        ops = self.model.ops_for(g)
        e = ops.rms_norm(F.embedding(tokens, self.embed), self.norm_e, self.eps)
        f = ops.rms_norm(g.to(self.embed.dtype), self.norm_f, self.eps)
        return linear(torch.cat([e, f], dim=-1), self.fc)


class EagleProposer(ProposerBase):
    drafting_costs = True

    def __init__(self, draft: EagleDraft, capacity: int, min_confidence: float = 0.0):
        self.draft = draft
        self.batch_key = draft
        self.needs_states = draft.feature_layers  # the target layers whose states it reads
        self.cache = draft.model.new_cache(capacity)
        self.committed = 0  # target positions fed to the draft (their true states), or skipped
        self.skipped = 0  # the prompt's first positions, beyond the draft's context: not in its cache
        self.pending: list[torch.Tensor] = []  # target states of positions committed.. not fed yet
        self.min_confidence = min_confidence

    def observe_states(self, states: torch.Tensor) -> None:
        self.pending.append(states)

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                picks: DraftPicks) -> Proposal:
        return EagleProposer.propose_batch([(self, context, gamma, sampling, picks)])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_batch(requests: list[tuple[EagleProposer, list[int], int, SamplingParams, DraftPicks]]
                      ) -> list[Proposal]:
        """Proposals for requests sharing one draft, drafted in lockstep."""
        clock = DraftingClock()
        draft = requests[0][0].draft
        device = draft.embed.device
        items, live = [], []
        for i, (p, ctx, k, _, _) in enumerate(requests):
            if k <= 0 or not p.pending:
                continue
            states = torch.cat(p.pending) if len(p.pending) > 1 else p.pending[0]
            if p.committed == 0 and draft.context is not None and states.shape[0] > draft.context:
                p.skipped = p.committed = states.shape[0] - draft.context  # the prompt's tail only
                states = states[p.skipped:]
            m = p.committed + states.shape[0]  # positions the target has processed
            nxt = torch.tensor(ctx[p.committed + 1:m + 1], device=device)  # the token after each position
            p.cache.lengths[0] = p.committed - p.skipped  # forget last round's speculative positions
            items.append((draft.inputs(nxt, draft.reduced(states)), p.cache, False))
            p.committed, p.pending = m, []
            live.append(i)
        out = [empty(device) for _ in requests]
        if not items:
            return out
        logits, hidden = draft.model.forward_many(items, hidden=True)
        clock.lap({i: int(item[0].shape[0]) for i, item in zip(live, items)}, first=True)
        last = {i: h[-1:] for i, h in zip(live, hidden)}  # the predicted state for the next position
        logit = dict(zip(live, logits))
        toks: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        conf: dict[int, list[float]] = {i: [] for i in live}
        running = dict.fromkeys(live, 1.0)
        active = list(live)
        while active:
            feed = []
            for i in active:
                p, _, k, sp, picks = requests[i]
                raw = logit[i][0]  # [N] over the draft vocabulary
                if sp.temperature == 0:
                    j, q = int(argmax(raw)), None
                else:
                    q = logits_to_probs(logit[i], sp)[0]
                    j = picks.pick(q, len(toks[i]), draft.vocab_ids)
                # confidence from the unshaped distribution (greedy shaping is one-hot: always 1)
                top = float(raw.float().softmax(-1).max())
                toks[i].append(j)
                qs[i].append(q)
                conf[i].append(top)
                running[i] *= p.estimate(top)
                if len(toks[i]) < k and running[i] >= p.min_confidence:
                    feed.append(i)
            if not feed:
                break
            tok = {i: draft.vocab_ids[toks[i][-1]].view(1) for i in feed}
            logits, hidden = draft.model.forward_many(
                [(draft.inputs(tok[i], last[i]), requests[i][0].cache, False) for i in feed], hidden=True)
            clock.lap(dict.fromkeys(feed, 1))
            for i, lg, h in zip(feed, logits, hidden):
                logit[i], last[i] = lg, h
            active = feed
        clock.stop()
        for i in live:
            idx = torch.tensor(toks[i], device=device)
            ids = draft.vocab_ids[idx]
            probs = None
            if requests[i][3].temperature > 0:  # q over the full vocabulary: zero outside the draft's
                probs = torch.zeros(len(toks[i]), draft.vocab_size, device=device)
                probs[:, draft.vocab_ids] = torch.stack(qs[i])
            out[i] = Proposal(ids, probs, torch.tensor(conf[i]), cost=clock.cost(i))
        return out


# ---------------------------------------------------------------------- the artifact
WEIGHTS_FILE, CARD_FILE = "draft.safetensors", "card.json"
FORMAT = "specgate.eagle_draft.v1"


def save_draft(directory, tensors: dict[str, torch.Tensor], vocab_ids: torch.Tensor, card: dict) -> None:
    """The draft's own weights (bfloat16: a draft need not be exact) and its card."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = {k: tensors[k].detach().to("cpu", torch.bfloat16).contiguous() for k in TENSORS}
    out["vocab_ids"] = vocab_ids.to(torch.int32).contiguous()
    save_file(out, str(d / WEIGHTS_FILE))
    (d / CARD_FILE).write_text(json.dumps({"format": FORMAT, **card}, indent=1) + "\n")


def load_draft(directory, target_fingerprint: str, weights: str = "stored"
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """Tensors, vocabulary and card, after checking the card names this target; with
    `weights` "q8" or "q4", its matmuls' weights rounded to that block format
    (engines/panels.py: round_to). Raises ValueError naming both fingerprints for a
    draft trained for another model."""
    import json
    from pathlib import Path

    from safetensors.torch import load as load_bytes

    d = Path(directory)
    try:
        card = json.loads((d / CARD_FILE).read_text())
        data = load_bytes((d / WEIGHTS_FILE).read_bytes())  # into memory: no file mapping
    except (OSError, ValueError) as e:
        raise ValueError(f"eagle draft in {d}: cannot read it: {e}") from None
    if card.get("format") != FORMAT:
        raise ValueError(f"eagle draft in {d}: not a {FORMAT} artifact")
    if card.get("target_fingerprint") != target_fingerprint:
        raise ValueError(f"eagle draft in {d} was trained for target {card.get('target_fingerprint')}, "
                         f"but this target is {target_fingerprint}: retrain it with `specgate distill`")
    missing = [k for k in (*TENSORS, "vocab_ids") if k not in data]
    if missing:
        raise ValueError(f"eagle draft in {d}: missing tensors {missing}")
    tensors = {k: data[k].float() for k in TENSORS}
    if weights != "stored":
        tensors.update({k: round_to(tensors[k], weights) for k in MATMULS})
    return tensors, data["vocab_ids"].long(), card
