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
        self.lanes, self.rows = int(lib.panels_lanes()), int(lib.panels_rows())

    def fits(self, w: torch.Tensor) -> bool:
        """Whether a weight [out, in] can be laid out in panels."""
        return (w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
                and w.shape[1] % self.lanes == 0 and w.shape[0] > 0)


class Panel:
    """One weight [out, in] in panels; called with rows x [m, in], gives x @ wᵀ [m, out]."""

    def __init__(self, w: torch.Tensor, k: Kernel):
        self.k, (self.out, self.inner) = k, w.shape
        blocks = -(-self.out // k.rows)
        # torch's CPU allocator aligns to 64 bytes: the kernel reads the panels with aligned loads
        self.packed = torch.empty(blocks * k.rows * self.inner, dtype=torch.float32)
        k.lib.panels_pack(w.contiguous().data_ptr(), self.packed.data_ptr(), self.out, self.inner)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out, dtype=torch.float32)
        self.k.lib.panels_mm(self.packed.data_ptr(), x.data_ptr(), y.data_ptr(), self.out, self.inner, m,
                             self.out, torch.get_num_threads())
        return y

    def unpack(self) -> torch.Tensor:
        """The weight [out, in] it was made from."""
        w = torch.empty(self.out, self.inner, dtype=torch.float32)
        self.k.lib.panels_unpack(self.packed.data_ptr(), w.data_ptr(), self.out, self.inner)
        return w


@functools.cache
def kernel() -> Kernel | None:
    """The kernel built for this machine, once a process; None where it cannot be built
    or computes other than torch does (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("panels kernel: no C compiler found; the matmul routes keep MKL")
        return None
    with tempfile.TemporaryDirectory(prefix="specgate-panels-") as d:  # private (0700): nobody swaps the library
        lib_path, test_path = Path(d) / "panels.so", Path(d) / "selftest"
        try:
            # the same code as a program first: an instruction this CPU cannot run kills it, not us
            subprocess.run([cc, *TEST_FLAGS, "-o", str(test_path), str(SOURCE), "-lm"], check=True,
                           capture_output=True, timeout=120)
            subprocess.run([str(test_path)], check=True, capture_output=True, timeout=60)
            subprocess.run([cc, *FLAGS, "-o", str(lib_path), str(SOURCE)], check=True, capture_output=True,
                           timeout=120)
            k = Kernel(ctypes.CDLL(str(lib_path)))  # loaded: the file may go
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


def check(k: Kernel) -> str | None:
    """What is wrong with the kernel's results (None: nothing): against float64 products,
    a row alone against the same row beside others, the layout's round trip."""
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
    return None
