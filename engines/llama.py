"""A lean forward pass for Llama-family decoders (Llama, SmolLM2, Qwen2, Mistral).

Why our own: Hugging Face's eager forward spends most of a small model's decode
step in Python and module overhead, and verifying k tokens at once costs ~2x a
single step there, which eats the gain of speculation. Here a step is a short
run of fused matmuls over a preallocated KV cache; rolling back rejected draft
positions is just moving the cache length back.

The Hugging Face implementation is the reference: tests check logits match.

Shapes: B batch, T new tokens, S cached+new positions, H query heads,
Hk key/value heads, G = H // Hk, D head dim, E hidden size, V vocab.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.attention import RaggedAttention, attend, by_kv_head, by_token, fits
from engines.fused import FusedOps, TorchOps
from engines.fused import fits as fused_fits
from engines.layouts import linear
from engines.panels import Kernel

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "mistral"}
FLASH_MIN_TOKENS = 16  # a prefill chunk from position 0 at least this long takes the fused causal kernel
# rows feeding fewer tokens go to the attention kernel where the model has it (decode steps and
# verifications: several times faster than torch's ops, bench/attention.py); a longer chunk's
# queries share its keys, which torch's bmm exploits and the kernel does not
KERNEL_MAX_TOKENS = FLASH_MIN_TOKENS - 1


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @staticmethod
    def from_hf(hf_config) -> LlamaConfig:
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not a Llama-family decoder "
                f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return LlamaConfig(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_positions=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        )


@dataclass
class LayerWeights:
    """One decoder layer's weights; on CPU the matmul weights (qkv, o, gate_up, down,
    and the head) may be laid out for oneDNN or carry MKL-packed copies (engines/layouts.py):
    read them through layouts.linear / layouts.dense."""

    attn_norm: torch.Tensor  # [E]
    qkv: torch.Tensor  # [(H + 2 Hk) D, E], q, k, v stacked so one matmul serves all three
    qkv_bias: torch.Tensor | None  # [(H + 2 Hk) D]
    o: torch.Tensor  # [E, H D]
    mlp_norm: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [2 I, E], gate and up stacked
    down: torch.Tensor  # [E, I]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [V, E]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [E]
    lm_head: torch.Tensor  # [V, E] (the embedding itself when tied)
    inv_freq: torch.Tensor  # [D / 2] float32
    rope_scale: float  # attention scaling some RoPE variants apply to cos/sin

    @staticmethod
    def from_state_dict(
        cfg: LlamaConfig, sd: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, device: str
    ) -> LlamaWeights:
        """Build from a Hugging Face `LlamaForCausalLM` state dict. Copies into fresh,
        contiguous tensors: nothing stays backed by a file mapping."""

        def get(name: str) -> torch.Tensor:
            return sd[name].to(device=device, dtype=dtype)

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                 get(p + "self_attn.v_proj.weight")]
            ).contiguous()
            bias = None
            if cfg.qkv_bias and (p + "self_attn.q_proj.bias") in sd:
                bias = torch.cat(
                    [get(p + "self_attn.q_proj.bias"), get(p + "self_attn.k_proj.bias"),
                     get(p + "self_attn.v_proj.bias")]
                ).contiguous()
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight").clone(),
                    qkv=qkv,
                    qkv_bias=bias,
                    o=get(p + "self_attn.o_proj.weight").clone().contiguous(),
                    mlp_norm=get(p + "post_attention_layernorm.weight").clone(),
                    gate_up=gate_up.contiguous(),
                    down=get(p + "mlp.down_proj.weight").clone().contiguous(),
                )
            )
        embed = get("model.embed_tokens.weight").clone().contiguous()
        if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
            lm_head = embed
        else:
            lm_head = get("lm_head.weight").clone().contiguous()
        inv_freq, rope_scale = rope_parameters(hf_config, device)
        return LlamaWeights(embed, layers, get("model.norm.weight").clone(), lm_head, inv_freq, rope_scale)


def rope_parameters(hf_config, device: str) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling, from Hugging Face's own rotary embedding so
    every RoPE variant it knows (default, linear, dynamic base, llama3, yarn) matches."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic RoPE scaling changes with sequence length and is not supported")
    rotary = LlamaRotaryEmbedding(config=hf_config)
    return rotary.inv_freq.detach().float().to(device), float(getattr(rotary, "attention_scaling", 1.0))


class KVCache:
    """Preallocated keys and values for a set of layers and a batch of rows.

    `lengths[b]` is how many positions of row b are valid. Rollback after a
    rejected draft is `lengths[b] = n`: stale entries beyond it are overwritten
    by the next forward and never attended to.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: str):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hk, S_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.lengths = [0] * batch

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def row(self, b: int) -> KVCache:
        """Row b as a one-row cache sharing this one's keys and values (what
        forward_many takes); its length is its own copy: set lengths[b] after use."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, b:b + 1], self.v[:, b:b + 1]
        view.capacity, view.lengths = self.capacity, [self.lengths[b]]
        return view


class LlamaModel:
    """A decoder over `weights`, optionally running only `layer_ids` (self-speculation:
    a subset of the target's own layers with its final norm and head, sharing tensors)."""

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, layer_ids: Sequence[int] | None = None):
        self.cfg = cfg
        self.weights = weights
        self.layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        if any(not 0 <= i < cfg.num_layers for i in self.layer_ids):
            raise ValueError(f"layer ids must be in [0, {cfg.num_layers}), got {self.layer_ids}")
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device  # the embedding stays dense: it is gathered, not multiplied
        self._rope_cache_len = 0
        self._cos = self._sin = None
        # greedy rows' head in two stages (engines/greedy_head.py), where the start-up chose it
        self.greedy_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # the step's rows attended in one call a layer (engines/attention.py), where it built
        self.attention_kernel: Kernel | None = None
        # each layer's norms, RoPE and SiLU one kernel call each (engines/fused.py), where it built
        self.fused: FusedOps | None = None

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return KVCache(len(self.layer_ids), batch, self.cfg.num_kv_heads, capacity,
                       self.cfg.head_dim, self.dtype, str(self.device))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, D] for absolute positions [T]; the table grows on demand."""
        need = int(positions.max()) + 1
        if need > self._rope_cache_len:
            size = max(need, 2 * self._rope_cache_len, 256)
            t = torch.arange(size, dtype=torch.float32, device=self.device)
            freqs = torch.outer(t, self.weights.inv_freq)  # [S, D/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
            scale = self.weights.rope_scale
            self._cos = (emb.cos() * scale).to(self.dtype)
            self._sin = (emb.sin() * scale).to(self.dtype)
            self._rope_cache_len = size
        return self._cos[positions], self._sin[positions]

    def forward(self, input_ids: torch.Tensor, cache: KVCache, all_logits: bool = True) -> torch.Tensor:
        """Run T new tokens of one sequence after its cached prefix: forward_many of one."""
        return self.forward_many([(input_ids, cache, all_logits)])[0]

    @torch.inference_mode()
    def forward_many(self, items: Sequence[tuple], hidden: bool | tuple[int, ...] = False):
        """One forward over several sequences, each with its own cache and its own
        number of new tokens (ragged: a decode step, a verification, a prefill chunk).

        items: (inputs, cache, all_logits[, greedy]), inputs either token ids [T_i] or input
        vectors [T_i, E] (a draft that builds its own inputs); `greedy` (default False):
        only the argmax of this item's logits is read, so they may come from
        `greedy_head` (exact at the argmax, -inf where a token cannot be it). Appends each
        sequence's keys and values after its valid prefix and advances it. The
        matmuls run once over all N = sum(T_i) tokens, so weights are read once per
        step; attention runs per sequence over its own cache. Returns logits
        [T_i, V], or [1, V] for the last position only where all_logits is False (a
        prefill needs no more, and the head is a fifth of a small model). With
        `hidden`, returns (logits, states): the final hidden states before the last
        norm, [T_i, E] for every position of every item (what an EAGLE draft reads);
        a tuple of layer indices instead gives the outputs of those layers side by
        side, [T_i, E · len(layers)] (-1: the final state).
        """
        cfg = self.cfg
        H, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // Hk
        manual = self.device.type == "cpu"  # see attend(): SDPA's dispatch outweighs decode-sized attention there
        spans, coss, sins = [], [], []
        for ids, cache, *_ in items:
            T = ids.shape[0]
            start = cache.lengths[0]
            end = start + T
            if end > cache.capacity:
                raise ValueError(f"KV cache full: {end} positions > capacity {cache.capacity}")
            cos, sin = self._rope(torch.arange(start, end, device=self.device))  # [T, D]
            coss.append(cos)
            sins.append(sin)
            mask = None
            if T > 1 and not manual and not (start == 0 and T >= FLASH_MIN_TOKENS):
                # query t (absolute start+t) sees keys 0..start+t; queries are laid out
                # [Hk, G*T] so the mask repeats per group.
                mask = torch.ones(T, end, dtype=torch.bool, device=self.device).tril(diagonal=start).repeat(G, 1)
            spans.append((T, start, end, mask, cache))
        one = len(items) == 1
        # the rows the kernel attends, in one call a layer
        ragged, ragged_all = None, False
        if manual and fits(self.attention_kernel, spans[0][4].k, D):
            offs = list(itertools.accumulate((T for T, *_ in spans), initial=0))[:-1]
            mine = [i for i, (T, *_) in enumerate(spans) if T <= KERNEL_MAX_TOKENS]
            ragged = RaggedAttention(self.attention_kernel, [(spans[i][0], spans[i][1], spans[i][4]) for i in mine],
                                     [offs[i] for i in mine], H, Hk, D) if mine else None
            ragged_all = len(mine) == len(spans)
        ids = items[0][0] if one else torch.cat([it[0] for it in items])  # [N]
        cos = coss[0] if one else torch.cat(coss)  # [N, D]
        sin = sins[0] if one else torch.cat(sins)

        def attention(slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if ragged is not None:
                out = torch.empty(q.shape[0], H * D, dtype=q.dtype)  # [N, H D]
                ragged(slot, q, k, v, out)
                if ragged_all:
                    return out
            outs, off = [], 0
            for T, start, end, mask, cache in spans:
                if ragged is not None and T <= KERNEL_MAX_TOKENS:
                    outs.append(out[off:off + T])  # attended above
                    off += T
                    continue
                k_cache = cache.k[slot, 0]  # [Hk, S_max, D]
                v_cache = cache.v[slot, 0]
                k_cache[:, start:end] = k[off:off + T].transpose(0, 1)
                v_cache[:, start:end] = v[off:off + T].transpose(0, 1)
                if start == 0 and T >= FLASH_MIN_TOKENS:
                    # A prefill from scratch: is_causal lets SDPA take its fused kernel (an explicit
                    # mask forces the math path: 1.6x slower on a 1000-token prompt). Repeating the
                    # kv heads costs little at this size. Query head h uses kv head h // G.
                    qh = q[off:off + T].transpose(0, 1)  # [H, T, D]
                    kr = k_cache[:, :end].repeat_interleave(G, dim=0)  # [H, S, D]
                    vr = v_cache[:, :end].repeat_interleave(G, dim=0)
                    # 4-D inputs: the fused CPU kernel is not taken for 3-D ones
                    a = F.scaled_dot_product_attention(qh[None], kr[None], vr[None], is_causal=True)[0]  # [H, T, D]
                    outs.append(a.transpose(0, 1).reshape(T, H * D))
                else:
                    # GQA without copying keys: group g of query heads shares kv head g.
                    qg = by_kv_head(q[off:off + T], Hk)  # [Hk, G T, D]
                    if manual:
                        a = attend(qg, k_cache[:, :end], v_cache[:, :end], T)
                    else:
                        a = F.scaled_dot_product_attention(qg, k_cache[:, :end], v_cache[:, :end], attn_mask=mask)
                    outs.append(by_token(a, T))
                off += T
            return outs[0] if one else torch.cat(outs)  # [N, H D]

        x = ids if ids.is_floating_point() else F.embedding(ids, self.weights.embed)  # [N, E]
        x, captured = self._stack(x, cos, sin, attention, hidden)
        for _, _, end, _, cache in spans:
            cache.lengths[0] = end
        # the head only where logits are wanted
        rows, sizes, greedy, off = [], [], [], 0
        for (T, *_), (_, _, want_all, *flag) in zip(spans, items):
            rows.append(torch.arange(off, off + T) if want_all else torch.tensor([off + T - 1]))
            sizes.append(T if want_all else 1)
            greedy += [bool(flag and flag[0])] * sizes[-1]
            off += T
        sel = torch.cat(rows).to(self.device) if not (one and items[0][2]) else None
        logits = self._logits(x if sel is None else x[sel], greedy)  # [sum sizes, V]
        logits = list(logits.split(sizes)) if not one else [logits]
        if hidden is False:
            return logits
        return logits, list(captured.split([t for t, *_ in spans]))

    def ops_for(self, x: torch.Tensor) -> FusedOps | type[TorchOps]:
        """The layers' small ops for states like x: the kernel's where it takes them."""
        return self.fused if fused_fits(self.fused, x) else TorchOps

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Final states [N, E] -> normed as the head reads them."""
        return self.ops_for(x).rms_norm(x, self.weights.norm, self.cfg.rms_norm_eps)

    def _logits(self, x: torch.Tensor, greedy: list[bool] | None = None) -> torch.Tensor:
        """Final states [N, E] -> float32 logits [N, V]: the last norm, then the head
        (greedy rows' through greedy_head where there is one)."""
        x = self.final_norm(x)
        if self.greedy_head is None or not greedy or not any(greedy):
            return linear(x, self.weights.lm_head).float()
        if all(greedy):
            return self.greedy_head(x)
        g = torch.tensor(greedy, device=x.device)
        sampled = linear(x[~g], self.weights.lm_head).float()  # [N - greedy, V]
        out = sampled.new_empty(x.shape[0], sampled.shape[1])
        out[~g] = sampled
        out[g] = self.greedy_head(x[g])
        return out

    def _stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
               hidden: bool | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over N positions: x [N, E] -> [N, E]. `attention(slot,
        q [N, H, D], k [N, Hk, D], v [N, Hk, D])` stores the keys and values in its
        caller's cache and returns [N, H D]. Also returns what `hidden` asks for
        (forward_many's docstring), else None."""
        cfg = self.cfg
        H, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        last = len(self.layer_ids) - 1
        capture = () if hidden is True or hidden is False else tuple(last if i == -1 else i for i in hidden)
        captured: dict[int, torch.Tensor] = {}
        ops = self.ops_for(x)
        layers = [self.weights.layers[i] for i in self.layer_ids]
        h = ops.rms_norm(x, layers[0].attn_norm, eps)
        for slot, lw in enumerate(layers):
            q, k, v = ops.rope_qkv(linear(h, lw.qkv, lw.qkv_bias), cos, sin, H, Hk, D)  # [N, H|Hk|Hk, D]
            x, h = ops.add_rms_norm(x, linear(attention(slot, q, k, v), lw.o), lw.mlp_norm, eps)
            y = linear(ops.silu_mul(linear(h, lw.gate_up)), lw.down)  # [N, E]
            if slot < last:  # the residual add and the next layer's norm in one
                x, h = ops.add_rms_norm(x, y, layers[slot + 1].attn_norm, eps)
            else:
                x = x + y
            if slot in capture:
                captured[slot] = x
        if hidden is False:
            return x, None
        return x, (x if not capture else torch.cat([captured[i] for i in capture], dim=-1))

    @torch.inference_mode()
    def decode_padded(self, ids: torch.Tensor, cache: KVCache, hidden: bool | tuple[int, ...] = False):
        """One decode step for B rows of one padded cache (batch B), row b at its
        own position cache.lengths[b]: ids [B] -> logits [B, V] (and states [B, ·]
        with `hidden`, as forward_many). Attention runs once over the batch with a
        mask for each row's length: on a GPU that is a few kernels a layer where
        forward_many launches several per row; on a CPU the padding costs more than
        the launches, so the engine keeps forward_many there."""
        cfg = self.cfg
        H, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // Hk
        B = ids.shape[0]
        pos = torch.tensor(cache.lengths, device=self.device)  # [B]
        end = max(cache.lengths) + 1
        if end > cache.capacity:
            raise ValueError(f"KV cache full: {end} positions > capacity {cache.capacity}")
        rows = torch.arange(B, device=self.device)
        mask = (torch.arange(end, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, S]
        cos, sin = self._rope(pos)  # [B, D]

        def attention(slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = cache.k[slot], cache.v[slot]  # [B, Hk, S_max, D]
            k_cache[rows, :, pos] = k
            v_cache[rows, :, pos] = v
            qg = q.view(B, Hk, G, D)  # query head h uses kv head h // G: G queries per kv head
            a = F.scaled_dot_product_attention(qg, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
            return a.reshape(B, H * D)

        x, states = self._stack(F.embedding(ids, self.weights.embed), cos, sin, attention, hidden)
        cache.lengths = [n + 1 for n in cache.lengths]
        logits = self._logits(x)  # [B, V]
        return logits if hidden is False else (logits, states)

