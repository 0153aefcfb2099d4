"""A few rows' matmuls over weights re-laid in panels, by a kernel built at start-up.

A decode step, or a lone row verifying drafts, multiplies a few rows by every
weight once: its time is how fast the weights stream from memory. MKL's
W @ xᵀ (engines/layouts.py: Columns) streams them at memory speed for one or
two rows but not beyond: on an AMD EPYC, 30 layers of SmolLM2's matmuls took
13.2 ms for 1 row, 18.7 for 3, 19.0 for 4 and 30.7 for 8 (bench/matmuls.py).
engines/kernels/panels.c lays each weight out as one sequential stream of
4-row panels and multiplies every input row by a panel while it sits in L1:
13.4, 13.4, 14.6 and 24.3 ms, so verifying 3 or 4 drafts costs what a decode
step does.

Every product is summed in one order whatever rows it is fed with, so a row's
result does not depend on its batch: a token decoded alone and the same token
verified beside drafts get the same bits from every routed matmul.

A weight streams in the smallest block format that gives back its exact float32
values (`encode`): a GGUF model's weights, dequantized on loading, are exactly
Q4_1 (SmolLM2's layers: 0.75 bytes a weight in panels, against 4) or Q8_0 (its
head: 1.125), and a draft stored in bfloat16 is exactly that (2). The kernel
expands the codes to those float32 values in registers and sums them in the
same order, so the results are the float32 panels' to the bit, for a fifth of
the bytes read; nothing is approximated (a weight one value off its format
stays float32). With AVX2's 16 vector registers a pass over a block format
takes each panel as two halves of 2 output rows, for up to 6 input rows,
instead of whole panels for 3: the codes are expanded once for twice the rows
(SmolLM2's Q4_1 layers on an AMD EPYC: 2 / 3 / 4 / 6 rows 0.87 / 0.84 / 0.52 /
0.65x the time of whole-panel passes, a lone row unchanged; bench/matmuls.py
--against).

The kernel is compiled from its C source with the machine's C compiler for the
machine's own instruction set (~1 s, in a private temporary folder), run first
as a program of its own (a virtual machine may advertise instructions it does
not allow: that kills the program, not the engine), then loaded and checked
against torch; without a compiler, or if a check fails, the routes keep MKL
(logged). The start-up profile times it against MKL.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "panels.c"
ATTENTION_SOURCE = SOURCE.with_name("attention.c")  # built into the same library: engines/attention.py
FUSED_SOURCE = SOURCE.with_name("fused.c")  # and engines/fused.py
SOURCES = (SOURCE, ATTENTION_SOURCE, FUSED_SOURCE, SOURCE.with_name("vec.h"))  # what the library is built from
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
TEST_FLAGS = ("-O3", "-march=native", "-fopenmp", "-DPANELS_SELFTEST")
_F, _L = ctypes.c_void_p, ctypes.c_long


class Kernel:
    """The compiled library: its vector width (lanes) and panel height (rows)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.panels_mm.argtypes = [_F, _F, _F, _L, _L, _L, _L, ctypes.c_int]
        lib.panels_mm.restype = ctypes.c_int
        lib.panels_pack.argtypes = lib.panels_unpack.argtypes = [_F, _F, _L, _L]
        lib.qpanels_mm.argtypes = [ctypes.c_int, _F, _F, _F, _L, _L, _L, _L, ctypes.c_int]
        lib.qpanels_mm.restype = ctypes.c_int
        lib.qpanels_pack.argtypes = [ctypes.c_int, _F, _F, _F, _F, _L, _L]
        lib.qpanels_unpack.argtypes = [ctypes.c_int, _F, _F, _L, _L]
        lib.qpanels_block_bytes.argtypes, lib.qpanels_block_bytes.restype = [ctypes.c_int], _L
        lib.ragged_attend.argtypes = [_L, _F, _F, _F, _F, _F, _F, _L, _F, _F, _F, _L, _F, _L, _F, _L, _F, _L, _L,
                                      _L, ctypes.c_float, ctypes.c_int]
        lib.ragged_attend.restype = ctypes.c_int
        self.lanes, self.rows = int(lib.panels_lanes()), int(lib.panels_rows())
        lib.panels_inputs.argtypes = [ctypes.c_int]
        # input rows a pass takes, per weight format (a forward's tokens go through the panels this many at a time)
        self.inputs = {f: int(lib.panels_inputs(c)) for f, c in {"float32": 0, **FORMATS}.items()}
        self.attention_lanes = int(lib.attention_lanes())
        self.formats = all(lib.qpanels_block_bytes(c) > 0 for c in FORMATS.values())  # AVX2 or AVX-512

    def fits(self, w: torch.Tensor) -> bool:
        """Whether a weight [out, in] can be laid out in panels."""
        return (w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
                and w.shape[1] % self.lanes == 0 and w.shape[0] > 0)


class Panel:
    """One weight [out, in] in panels, in the smallest format that gives back its exact
    float32 values (`fmt`: see FORMATS); called with rows x [m, in], gives x @ wᵀ [m, out]."""

    def __init__(self, w: torch.Tensor, k: Kernel, formats: bool = True):
        self.k, (self.out, self.inner) = k, w.shape
        blocks = -(-self.out // k.rows)
        w = w.contiguous()
        enc = encode(w) if formats and k.formats and self.inner % BLOCK == 0 else None
        if enc is None:
            self.fmt = "float32"
            # torch's CPU allocator aligns to 64 bytes: the kernel reads the panels with aligned loads
            self.packed = torch.empty(blocks * k.rows * self.inner, dtype=torch.float32)
            k.lib.panels_pack(w.data_ptr(), self.packed.data_ptr(), self.out, self.inner)
            return
        self.fmt, codes, d, m = enc
        self._code = FORMATS[self.fmt]
        nbytes = blocks * (self.inner // BLOCK) * k.lib.qpanels_block_bytes(self._code)
        self.packed = torch.empty(nbytes, dtype=torch.uint8)
        k.lib.qpanels_pack(self._code, codes.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(),
                           self.packed.data_ptr(), self.out, self.inner)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out, dtype=torch.float32)
        if self.fmt == "float32":
            self.k.lib.panels_mm(self.packed.data_ptr(), x.data_ptr(), y.data_ptr(), self.out, self.inner, m,
                                 self.out, torch.get_num_threads())
        else:
            self.k.lib.qpanels_mm(self._code, self.packed.data_ptr(), x.data_ptr(), y.data_ptr(), self.out,
                                  self.inner, m, self.out, torch.get_num_threads())
        return y

    @property
    def inputs(self) -> int:
        """Input rows one pass over this weight takes."""
        return self.k.inputs[self.fmt]

    def unpack(self) -> torch.Tensor:
        """The weight [out, in] it was made from."""
        w = torch.empty(self.out, self.inner, dtype=torch.float32)
        if self.fmt == "float32":
            self.k.lib.panels_unpack(self.packed.data_ptr(), w.data_ptr(), self.out, self.inner)
        else:
            self.k.lib.qpanels_unpack(self._code, self.packed.data_ptr(), w.data_ptr(), self.out, self.inner)
        return w


# ---------------------------------------------------------------------- block formats
BLOCK = 32  # weights a block along the input, as GGUF's
FORMATS = {"q4": 1, "q8": 2, "bfloat16": 3}  # panels.c's QP_*; smallest first
_ROWS_AT_ONCE = 4096  # rows encoded at a time: bounds the temporaries for a large head


def encode(w: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The smallest block format whose codes give back every value of w [out, in] exactly
    (in % BLOCK == 0): (format, codes [out, in], d [out, in / BLOCK], m or None); None:
    only float32 does. A GGUF model's weights, dequantized to float32, are exactly Q4_1
    (w = d·q + m, d and m half precision, q 4 bits) or Q8_0 (w = d·q, q 8 bits); a draft
    stored in bfloat16 is exactly bfloat16. Nothing is approximated: a weight one value
    off its format stays float32."""
    for fmt, fn in (("q4", _q4), ("q8", _q8)):
        parts = []
        for rows in w.split(_ROWS_AT_ONCE):
            part = fn(rows.reshape(rows.shape[0], -1, BLOCK))
            if part is None:
                break
            parts.append(part)
        else:
            codes, d, m = (None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(3))
            return fmt, codes.reshape(w.shape).contiguous(), d.contiguous(), m
    if torch.equal(w.bfloat16().float(), w):
        return "bfloat16", w.bfloat16().view(torch.int16).contiguous(), torch.zeros(1), None
    return None


def round_to(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [out, in] (in % BLOCK == 0) rounded to the nearest values of a block format, as a
    quantizer writes them ("q8": Q8_0, "q4": Q4_1): what `encode` then recognises, so the
    kernel streams it in that format. For weights that need not be exact (a draft's)."""
    b = w.float().reshape(w.shape[0], -1, BLOCK)
    if fmt == "q8":
        lo, d = 0.0, (b.abs().amax(-1) / 127).half().float()
        span = (-127, 127)
    elif fmt == "q4":
        lo = b.amin(-1).half().float()
        d = ((b.amax(-1) - lo) / 15).half().float()
        lo, span = lo[..., None], (0, 15)
    else:
        raise ValueError(f"no block format {fmt!r}: q8 or q4")
    q = torch.where(d[..., None] > 0, (b - lo) / d[..., None], 0.0).round().clamp(*span)
    return (d[..., None] * q + lo).reshape(w.shape)


def _scales(first: torch.Tensor) -> list[torch.Tensor]:
    """A block's half-precision scale as first estimated, and its neighbours an ulp away
    (the scale a quantizer stored was rounded from one computed slightly otherwise)."""
    h = first.clamp(min=0).half().view(torch.int16)
    return [h.view(torch.float16).float()] + [(h + s).clamp(min=0).view(torch.float16).float() for s in (1, -1)]


def _fit(b: torch.Tensor, candidates: list[torch.Tensor], lo: int, hi: int, m: torch.Tensor | None):
    """Per block the first candidate d whose codes round(b − m) / d in [lo, hi] give b back
    exactly: (codes, d), or None where some block has none. b [R, N, BLOCK]."""
    shift = b if m is None else b - m[..., None]
    codes = d = None
    left = torch.ones(b.shape[:2], dtype=torch.bool)
    for c in candidates:
        q = torch.where(c[..., None] > 0, shift / c[..., None], 0.0).round().clamp(lo, hi)
        back = c[..., None] * q
        if m is not None:
            back = back + m[..., None]
        ok = left & (back == b).all(-1)
        if codes is None:
            codes, d = q, c.clone()
        codes[ok], d[ok] = q[ok], c[ok]
        left &= ~ok
        if not left.any():
            return codes, d
    return None


def _q4(b: torch.Tensor):
    m = b.amin(-1)
    fit = _fit(b, _scales((b.amax(-1) - m) / 15), 0, 15, m)
    return None if fit is None else (fit[0].to(torch.uint8), fit[1], m)


def _q8(b: torch.Tensor):
    fit = _fit(b, _scales(b.abs().amax(-1) / 127), -128, 127, None)
    return None if fit is None else (fit[0].to(torch.int8), fit[1], None)


@functools.cache
def kernel() -> Kernel | None:
    """The kernel built for this machine, once a process; None where it cannot be built
    or computes other than torch does (logged)."""
    try:
        k = build(SOURCE)
    except LookupError as e:
        log.info("panels kernel: %s; the matmul routes keep MKL", e)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("panels kernel: build failed (%s) %s; the matmul routes keep MKL", e,
                    err.decode(errors="replace")[-500:])
        return None
    problem = check(k)
    if problem:
        log.warning("panels kernel: %s; the matmul routes keep MKL", problem)
        return None
    log.info("panels kernel built (%d lanes, %d-row panels)", k.lanes, k.rows)
    return k


def build(source: Path) -> Kernel:
    """Compile `source` (with the attention kernel and the fused ops beside it) for this machine, run it
    first as a program of its own (an instruction this CPU cannot run kills that, not
    us), then load it. Raises LookupError without a C compiler, OSError or
    SubprocessError where a step fails; `check` is the caller's."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise LookupError("no C compiler found")
    with tempfile.TemporaryDirectory(prefix="specgate-panels-") as d:  # private (0700): nobody swaps the library
        lib_path, test_path = Path(d) / "panels.so", Path(d) / "selftest"
        sources = (str(source), str(ATTENTION_SOURCE), str(FUSED_SOURCE))
        subprocess.run([cc, *TEST_FLAGS, "-o", str(test_path), *sources, "-lm"], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([str(test_path)], check=True, capture_output=True, timeout=60)
        subprocess.run([cc, *FLAGS, "-o", str(lib_path), *sources, "-lm"], check=True,
                       capture_output=True, timeout=120)
        return Kernel(ctypes.CDLL(str(lib_path)))  # loaded: the file may go


def check(k: Kernel) -> str | None:
    """What is wrong with the kernel's results (None: nothing): against float64 products,
    a row alone against the same row beside others, the layout's round trip, and every
    block format against the float32 panels of the same values, to the bit."""
    g = torch.Generator().manual_seed(0)
    for out, inner in ((37, 2 * k.lanes), (64, 3 * k.lanes)):  # a partial last panel; several passes of rows
        w = torch.randn(out, inner, generator=g)
        p = Panel(w, k)
        if not torch.equal(p.unpack(), w):
            return "the panels do not unpack to the weight"
        for m in (1, 2, 5, 9):
            x = torch.randn(m, inner, generator=g)
            y, want = p(x), (x.double() @ w.double().t())
            if not torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                return f"{m} rows of [{out}, {inner}] differ from float64 products"
            if not torch.equal(p(x[-1:]), y[-1:]):
                return "a row's result depends on the rows beside it"
    for fmt in FORMATS if k.formats else ():
        w = exactly(fmt, 37, 3 * BLOCK, g)
        p, f32 = Panel(w, k), Panel(w, k, formats=False)
        if p.fmt != fmt or not torch.equal(p.unpack(), w):
            return f"a {fmt} weight does not go to panels in {fmt} and back"
        x = torch.randn(9, 3 * BLOCK, generator=g)
        for m in (1, 4, 9):
            if not torch.equal(p(x[:m]), f32(x[:m])):
                return f"{m} rows by a {fmt} panel are not the float32 panel's bits"
    return None


def exactly(fmt: str, out: int, inner: int, g: torch.Generator) -> torch.Tensor:
    """A random weight [out, in] whose float32 values are exactly those of a block format,
    as a quantizer writes them (Q4_1: each block's least value has code 0 and its greatest 15)."""
    shape = (out, inner // BLOCK, BLOCK)
    d = (torch.rand(out, inner // BLOCK, 1, generator=g) * 0.02).half().float()
    if fmt == "q4":
        q = torch.randint(0, 16, shape, generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (-torch.rand(out, inner // BLOCK, 1, generator=g) * 0.1).half().float()
        return (d * q + m).reshape(out, inner)
    if fmt == "q8":
        q = torch.randint(-127, 128, shape, generator=g).float()
        q[..., 0] = 127
        return (d * q).reshape(out, inner)
    return torch.randn(out, inner, generator=g).bfloat16().float()
