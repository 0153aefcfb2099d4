"""The start-up profile, kept per machine so that a restart need not measure again.

A CPU profile (engines/profile.py: the layout and thread count this machine
runs fastest, and what its forwards cost) takes ~16 s on 2 cores for SmolLM2,
more for larger models. It depends on the CPU (its model, family, stepping and
flags: machines lscpu names alike have differed 3x), the cores this process
may use, torch's build, the models' shapes and dtype and what the config lets
the profile choose, all of which make its key; not on the weights' values. A
later start whose key matches takes the profile's choices and prices from the
file; the step-cost model goes on learning from every step either way, and
`target.profile_cache: false` measures at every start. The forwards the
layouts were ranked by are timed again first, in the kept layout and in the
runner-up (~2 s): a profile taken while something else ran on the cores (~10x
slower) or on a machine that has since changed prices every forward wrongly,
and one whose choice a slow spell decided would keep a layout 1.4x slower for
good, so a profile whose forwards now run more than DRIFT off its figures, or
whose runner-up now beats its choice by RIVAL, is measured over (the routes to
MKL-packed copies and as W @ xᵀ are taken as kept, not timed again). The file is
plain JSON (nothing executable), checked field by field on reading: one that
does not parse, match or check is measured over and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from engines.layouts import LAYOUTS, pack_rows, packs_agree, route_columns
from engines.llama import LlamaModel, LlamaWeights
from engines.panels import SOURCES, kernel
from engines.profile import Profile, choose_layout, combination, layouts_to_try, probe_s

log = logging.getLogger(__name__)

# v2: the routes as W @ xᵀ and the step cost's jump off them (h); v3: their kernel; v4: their trials to 32 tokens;
# v5: the step cost's own slope per token on the route as W @ xᵀ (k); v6: its price per further pass of the panels (p)
FORMAT = "specgate.profile.v6"
DRIFT = 1.3  # a kept profile is taken while its probe forwards now run within this factor of its figure
RIVAL = 1.1  # ... and while its runner-up does not now run them this much faster
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def cpu_identity() -> dict:
    """The first processor's identifying fields from /proc/cpuinfo (the flags hashed),
    or what `platform` says where there is none."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {"processor": platform.processor(), "machine": platform.machine()}
    fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
    out = {k: v.strip() for k, v in ((k.strip(), v) for k, v in fields.items()) if k in _CPU_FIELDS}
    if "flags" in out:
        out["flags"] = hashlib.sha256(out["flags"].encode()).hexdigest()[:16]
    return out


def profile_key(model: LlamaModel, weights: list[LlamaWeights], pack: bool | str, threads: int | None,
                bf16: bool | str, routes: bool = True) -> tuple[str, dict]:
    """The key a profile is kept under (a digest) and what it digests."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = {
        "cpu": cpu_identity(), "cores": cores, "torch": torch.__version__, "model": repr(model.cfg),
        "dtype": str(model.dtype), "weights": [[len(w.layers), list(w.embed.shape)] for w in weights],
        "pack": pack, "threads": threads, "bf16": bf16, "routes": routes,
        # the routes' own kernel: a profile timed with another source of it ranks kernels that no longer run
        "kernel": hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16],
        "attention_kernel": model.attention_kernel is not None,  # its forwards' prices differ
        "fused_ops": model.fused is not None,  # likewise
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20], parts


def cpu_profile(model: LlamaModel, weights: list[LlamaWeights], pack: bool | str, threads: int | None,
                bf16: bool | str, cache_dir: Path | None, drift: float = DRIFT, rival: float = RIVAL,
                routes: bool = True) -> Profile:
    """The profile kept for this machine and these models, its choices put in place,
    if `cache_dir` has one that applies; else measured (choose_layout) and kept
    there. `cache_dir` None: measured, not kept."""
    if cache_dir is None:
        return choose_layout(model, weights, pack, threads, bf16, routes)
    key, parts = profile_key(model, weights, pack, threads, bf16, routes)
    path = cache_dir / "profiles" / f"{key}.json"
    if path.exists():
        prof = recall(path, key, model, weights, pack, bf16, drift, rival)
        if prof is not None:
            return prof
    log.info("measuring this machine for the start-up profile (~16 s on 2 cores for SmolLM2; kept in %s)", path)
    prof = choose_layout(model, weights, pack, threads, bf16, routes)
    keep(path, key, parts, prof)
    return prof


def recall(path: Path, key: str, model: LlamaModel, weights: list[LlamaWeights], pack: bool | str,
           bf16: bool | str, drift: float = DRIFT, rival: float = RIVAL) -> Profile | None:
    """The profile in `path` with its layout and threads put in place; None (and the
    weights left dense) where it cannot be read, is not this key's, no longer holds
    on this machine (`why_stale`) or its MKL-packed copies no longer compute what
    the dense weights do."""
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or d.get("key") != key:
            raise ValueError("another format or key")
        prof = Profile.from_dict(d["profile"])
        measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(d["measured_at"])))
        if any(combination(k)[1] not in layouts_to_try(pack, bf16) or combination(k)[0] > (os.cpu_count() or 1)
               for k in prof.step_s):
            raise ValueError("a layout or thread count this config or machine does not allow")
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        log.warning("start-up profile %s not used (%s): measuring again", path, e)
        return None
    why = "its routes run the panels kernel, which did not build here" if prof.panels and kernel() is None else None
    why = why or why_stale(prof, model, weights, drift, rival)
    if why is None and prof.packed_from is not None and not all(packs_agree(w) for w in weights):
        why = "its MKL-packed weights disagree with dense ones"
    if why is not None:
        for w in weights:
            LAYOUTS["dense"](w)
        log.warning("start-up profile %s: %s: measuring again", path, why)
        return None
    log.info("start-up profile kept in %s, measured %s; its forwards checked (target.profile_cache: false measures "
             "at every start)", path, measured)
    return prof


def why_stale(prof: Profile, model: LlamaModel, weights: list[LlamaWeights], drift: float = DRIFT,
                rival: float = RIVAL) -> str | None:
    """Why the kept choice is stale here (None: it still holds, and is in place): the
    probe forwards in its layout more than `drift` off what they took, or its runner-up
    now `rival` times faster. Each timed as choose_layout timed it: before any
    MKL-packed copies were chosen."""
    _lay_out(weights, prof.layout)
    torch.set_num_threads(prof.threads)
    now = probe_s(model)
    if not 1 / drift <= now / prof.step_s[prof.choice] <= drift:
        return f"its probe forwards took {prof.step_s[prof.choice] * 1e3:.1f} ms, now {now * 1e3:.1f} ms"
    others = sorted((s, k) for k, s in prof.step_s.items() if k != prof.choice)
    second, theirs = (others[0][1], None) if others else (None, None)
    if second is not None:
        threads, layout = combination(second)
        if layout != prof.layout:  # a thread count alone needs no new layout (a pass over every weight)
            _lay_out(weights, layout)
        torch.set_num_threads(threads)
        theirs = probe_s(model)
        if theirs * rival < now:
            return (f"{second} now runs its probe forwards in {theirs * 1e3:.1f} ms against {now * 1e3:.1f} "
                    f"for {prof.choice}")
        if layout != prof.layout:
            _lay_out(weights, prof.layout)
    if prof.packed_from is not None:
        for w in weights:
            pack_rows(w, prof.packed_from)
    route_columns(model.weights, prof.layers_upto, prof.head_upto, prof.panels)
    torch.set_num_threads(prof.threads)
    log.info("start-up profile check: %s %.1f ms (kept %.1f)%s", prof.choice, now * 1e3,
             prof.step_s[prof.choice] * 1e3, f"; runner-up {second} {theirs * 1e3:.1f} ms" if second else "")
    return None


def _lay_out(weights: list[LlamaWeights], layout: str) -> None:
    for w in weights:
        LAYOUTS[layout](w)


def keep(path: Path, key: str, parts: dict, prof: Profile) -> None:
    """Write the profile atomically (a reader never sees half a file); a cache that
    cannot be written costs the next start its half minute, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "key": key, "measured_at": time.time(), "machine": parts,
                                   "profile": prof.to_dict()}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the start-up profile in %s: %s", path, e)
