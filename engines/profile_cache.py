"""The start-up profile, kept per machine so that a restart need not measure again.

A CPU profile (engines/profile.py: the layout and thread count this machine
runs fastest, and what its forwards cost) takes about half a minute on 2 cores,
most of a restart. It depends on the CPU (its model, family, stepping and
flags: machines lscpu names alike have differed 3x), the cores this process may
use, torch's build, the models' shapes and dtype and what the config lets the
profile choose, all of which make its key; not on the weights' values. A later
start whose key matches takes the profile's choices and prices from the file;
the step-cost model goes on learning from every step either way, and
`target.profile_cache: false` measures at every start. A decode step is timed
first, though: a profile taken while something else ran on the cores (a step
~10x slower), or on a machine that has since changed, prices every forward
wrongly, so one whose decode step is more than DRIFT off is measured over.
The file is plain JSON (nothing executable), checked field by field on
reading: one that does not parse, match or check is measured over and
rewritten.
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

from engines.layouts import LAYOUTS, pack_rows, packs_agree
from engines.llama import LlamaModel, LlamaWeights
from engines.profile import Profile, choose_layout, decode_step_s, layouts_to_try

log = logging.getLogger(__name__)

FORMAT = "specgate.profile.v1"
DRIFT = 1.3  # a kept profile is taken while a decode step now runs within this factor of its price
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
                bf16: bool | str) -> tuple[str, dict]:
    """The key a profile is kept under (a digest) and what it digests."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = {
        "cpu": cpu_identity(), "cores": cores, "torch": torch.__version__, "model": repr(model.cfg),
        "dtype": str(model.dtype), "weights": [[len(w.layers), list(w.embed.shape)] for w in weights],
        "pack": pack, "threads": threads, "bf16": bf16,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20], parts


def cpu_profile(model: LlamaModel, weights: list[LlamaWeights], pack: bool | str, threads: int | None,
                bf16: bool | str, cache_dir: Path | None, drift: float = DRIFT) -> Profile:
    """The profile kept for this machine and these models, its choices put in place,
    if `cache_dir` has one that applies; else measured (choose_layout) and kept
    there. `cache_dir` None: measured, not kept."""
    if cache_dir is None:
        return choose_layout(model, weights, pack, threads, bf16)
    key, parts = profile_key(model, weights, pack, threads, bf16)
    path = cache_dir / "profiles" / f"{key}.json"
    if path.exists():
        prof = recall(path, key, model, weights, pack, bf16, drift)
        if prof is not None:
            return prof
    log.info("measuring this machine for the start-up profile (about half a minute on 2 cores; kept in %s)", path)
    prof = choose_layout(model, weights, pack, threads, bf16)
    keep(path, key, parts, prof)
    return prof


def recall(path: Path, key: str, model: LlamaModel, weights: list[LlamaWeights], pack: bool | str,
           bf16: bool | str, drift: float = DRIFT) -> Profile | None:
    """The profile in `path` with its layout and threads put in place; None (and the
    weights left dense) where it cannot be read, is not this key's, its MKL-packed
    copies no longer compute what the dense weights do, or a decode step now runs
    more than `drift` times faster or slower than it priced one."""
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or d.get("key") != key:
            raise ValueError("another format or key")
        prof = Profile.from_dict(d["profile"])
        measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(d["measured_at"])))
        if prof.layout not in layouts_to_try(pack, bf16) or prof.threads > (os.cpu_count() or 1):
            raise ValueError("a layout or thread count this config or machine does not allow")
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        log.warning("start-up profile %s not used (%s): measuring again", path, e)
        return None
    for w in weights:
        LAYOUTS[prof.layout](w)
    if prof.packed_from is not None:
        for w in weights:
            pack_rows(w, prof.packed_from)
        if not all(packs_agree(w) for w in weights):
            return _undo(weights, f"start-up profile {path}: MKL-packed weights disagree with dense ones")
    torch.set_num_threads(prof.threads)
    step, priced = decode_step_s(model), prof.cost.lone[1]
    if not 1 / drift <= step / priced <= drift:
        return _undo(weights, f"start-up profile {path} priced a decode step at {priced * 1e3:.1f} ms, which now "
                              f"takes {step * 1e3:.1f} ms")
    log.info("start-up profile kept in %s, measured %s; a decode step %.1f ms against %.1f priced "
             "(target.profile_cache: false measures at every start)", path, measured, step * 1e3, priced * 1e3)
    return prof


def _undo(weights: list[LlamaWeights], why: str) -> None:
    """Weights back to dense (as loaded) for a profile measured over."""
    for w in weights:
        LAYOUTS["dense"](w)
    log.warning("%s: measuring again", why)


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
