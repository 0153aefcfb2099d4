"""The draft as it is trained: an EAGLE-style head over the target.

    input at position i   the target's hidden states at position i, from a low, a
                          middle and its last layer (as in EAGLE-3), reduced to
                          one vector g_i, and the embedding of the token that
                          followed, x_{i+1} (each RMS-normed), fused by one
                          linear layer
    one decoder layer     Llama-style (attention with RoPE over the draft's own
                          earlier positions, SwiGLU MLP), initialised from the
                          target's last layer
    output o_i            a prediction of f_{i+1}; the target's own final norm and
                          the rows of its LM head for a reduced vocabulary (the
                          tokens the target writes most) give the next token
                          x_{i+2}

Training-time test (as in EAGLE-3): step s feeds the draft its own outputs of
step s-1 in place of the target's features, with an attention mask that shows
each chained position exactly what it would see when drafting for real: the
target's features up to where the chain began, then its own earlier steps.
The target's embedding, final norm and head rows are frozen buffers; only the
fusion layer, its norms and the decoder layer learn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.fused import apply_rope
from engines.layouts import dense
from engines.llama import LlamaWeights


class EagleHead(nn.Module):
    def __init__(self, target: LlamaWeights, cfg, vocab_ids: torch.Tensor, feature_layers: tuple[int, ...] = (-1,),
                 init_layer: int | None = None):
        super().__init__()
        if feature_layers[-1] != -1:
            raise ValueError("the last feature layer must be the final one (-1): the labels come from it")
        self.feature_layers = tuple(feature_layers)
        levels = len(feature_layers)
        E, H, Hk, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.E, self.H, self.Hk, self.D, self.eps = E, H, Hk, D, cfg.rms_norm_eps
        owned = lambda t: dense(t).detach().float().clone()  # noqa: E731
        src = target.layers[cfg.num_layers - 1 if init_layer is None else init_layer]
        self.norm_levels = nn.Parameter(torch.ones(levels, E))
        reduce = torch.zeros(E, levels * E)
        reduce[:, (levels - 1) * E:] = torch.eye(E)  # starts from the final state alone (EAGLE-1)
        self.reduce = nn.Parameter(reduce)
        self.norm_e = nn.Parameter(torch.ones(E))
        self.norm_f = nn.Parameter(torch.ones(E))
        fc = torch.zeros(E, 2 * E)
        fc[:, E:] = torch.eye(E)  # starts by passing the target's feature through
        fc[:, :E] = torch.randn(E, E) * (0.5 / E**0.5)
        self.fc = nn.Parameter(fc)
        self.attn_norm = nn.Parameter(owned(src.attn_norm))
        self.qkv = nn.Parameter(owned(src.qkv))
        self.o = nn.Parameter(owned(src.o))
        self.mlp_norm = nn.Parameter(owned(src.mlp_norm))
        self.gate_up = nn.Parameter(owned(src.gate_up))
        self.down = nn.Parameter(owned(src.down))
        self.register_buffer("embed", owned(target.embed), persistent=False)
        self.register_buffer("final_norm", owned(target.norm), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.register_buffer("head", owned(target.lm_head)[vocab_ids.long()], persistent=False)
        self.register_buffer("inv_freq", target.inv_freq.float().clone(), persistent=False)
        self.rope_scale = target.rope_scale

    # ------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def reduced(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's states at several layers [.., levels · E] -> one vector [.., E]."""
        shape = feats.shape[:-1]
        f = feats.float().reshape(*shape, self.norm_levels.shape[0], self.E)
        f = F.rms_norm(f, (self.E,), eps=self.eps) * self.norm_levels
        return f.reshape(*shape, -1) @ self.reduce.T

    def fuse(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """tokens [B, n], g [B, n, E] (reduced target states, or the draft's own
        outputs) -> layer inputs [B, n, E]."""
        e = F.rms_norm(F.embedding(tokens, self.embed), (self.E,), self.norm_e, self.eps)
        f = F.rms_norm(g.float(), (self.E,), self.norm_f, self.eps)
        return torch.cat([e, f], dim=-1) @ self.fc.T

    def qkv_of(self, x: torch.Tensor, cos, sin):
        """x [B, n, E] -> q [B, H, n, D], k, v [B, Hk, n, D] (RoPE applied)."""
        B, n, _ = x.shape
        H, Hk, D = self.H, self.Hk, self.D
        h = F.rms_norm(x, (self.E,), self.attn_norm, self.eps)
        q, k, v = (h @ self.qkv.T).split([H * D, Hk * D, Hk * D], dim=-1)
        q = apply_rope(q.reshape(B * n, H, D), cos.repeat(B, 1), sin.repeat(B, 1)).view(B, n, H, D)
        k = apply_rope(k.reshape(B * n, Hk, D), cos.repeat(B, 1), sin.repeat(B, 1)).view(B, n, Hk, D)
        return q.transpose(1, 2), k.transpose(1, 2), v.view(B, n, Hk, D).transpose(1, 2)

    def finish(self, x: torch.Tensor, q, keys, values, mask) -> torch.Tensor:
        """The rest of the decoder layer: attention of q over keys/values under
        mask [n, S], then the MLP. Returns the layer output [B, n, E]."""
        B, _, n, _ = q.shape
        G = self.H // self.Hk
        k = keys.repeat_interleave(G, dim=1)
        v = values.repeat_interleave(G, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, n, D]
        x = x + a.transpose(1, 2).reshape(B, n, self.H * self.D) @ self.o.T
        h = F.rms_norm(x, (self.E,), self.mlp_norm, self.eps)
        gate, up = (h @ self.gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down.T

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output [.., E] -> logits over the draft vocabulary [.., N]."""
        return F.rms_norm(out, (self.E,), self.final_norm, self.eps) @ self.head.T

    # ------------------------------------------------------------------ training
    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, n + 1], feats [B, n, levels · E] (the target's states at
        positions 0..n-1); returns the layer outputs of every training-time-test
        step, [B, n, E] each: step s at position j stands for the target's state
        at j + 1, from a chain that began at j - s + 1."""
        B, n, _ = feats.shape
        nxt = tokens[:, 1:n + 1]  # x_{i+1} for position i
        cos, sin = self.rope(torch.arange(n, device=feats.device))
        j = torch.arange(n, device=feats.device)
        keys, values, outs = [], [], []
        prev = None
        for s in range(1, steps + 1):
            if s == 1:
                inp_feats = self.reduced(feats)
            else:  # position j reads the previous step's output at j - 1
                inp_feats = torch.cat([prev[:, :1], prev[:, :-1]], dim=1)
            x = self.fuse(nxt, inp_feats)
            q, k, v = self.qkv_of(x, cos, sin)
            keys.append(k)
            values.append(v)
            blocks = [j[None, :] <= (j[:, None] - s + 1)]  # the target's features, up to the chain's start
            blocks += [j[None, :] == (j[:, None] - s + u) for u in range(2, s + 1)]  # the chain so far
            mask = torch.cat(blocks, dim=1)
            prev = self.finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            outs.append(prev)
        return outs

    def target_probs(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's next-token distribution over the draft vocabulary
        (renormalised), from its states [.., levels · E] (the last level is its final state)."""
        with torch.no_grad():
            return self.logits(feats[..., -self.E:].float()).softmax(dim=-1)

    def export(self) -> dict[str, torch.Tensor]:
        """What inference needs (engines/proposers/eagle.py); the rest is the target's."""
        return {"norm_levels": self.norm_levels, "reduce": self.reduce, "norm_e": self.norm_e,
                "norm_f": self.norm_f, "fc": self.fc, "attn_norm": self.attn_norm,
                "qkv": self.qkv, "o": self.o, "mlp_norm": self.mlp_norm, "gate_up": self.gate_up,
                "down": self.down}
