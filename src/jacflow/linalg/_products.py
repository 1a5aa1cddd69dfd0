"""Matrix products on the CPU by the faster of the two float32 kernels that torch ships.

torch multiplies matrices on the CPU with its BLAS, MKL in the official wheels. MKL runs its
AVX-512 code only on Intel processors and its AVX2 code on the others, which then get about half
of what their vector units can do. oneDNN, which the same wheels carry for convolutions, picks
its kernels from the instruction sets the processor reports. On an AMD EPYC with AVX-512 (one
thread, float32, products timed alone), oneDNN's product took 0.43x-0.61x MKL's time for
Gramians from ``[128, 432]`` to ``[32, 262144]`` and 0.45x-0.70x for weight-gradient products
such as ``[1024, 128] @ [128, 1024]``. Inside the engine's steps its gains start later (see
:data:`ONEDNN_MIN_WORK`): at about 16 million multiply-adds, 8 rows and columns of the result
and an inner size of 32, with results written into ``out=`` by slices of rows
(:data:`ONEDNN_SLICE_ELEMENTS`); below that it loses (it has a fixed cost of about 10 us, and
is up to 7x slower with a few rows). Both products are exact up to float32 rounding (relative
errors of a few 1e-7 against float64 for both).

Elsewhere (Intel processors, whose MKL takes AVX-512; processors without AVX-512; other BLAS
libraries; float64, which oneDNN does not multiply; accelerators; sparse tensors and subclasses;
products that autograd records, forward-mode AD, ``torch.func``'s transforms, autocast,
``torch.compile``, a dispatch or torch-function mode or ``torch.jit`` see; oneDNN turned off by
``torch.backends.mkldnn.flags``) the product is torch's.

Not taken: a recursive 2 x 2 blocking that computes each off-diagonal block once (about half
the multiply-adds). It was 27-35% faster on one early host, within -10% to +2% on a later one,
and 0-45% slower on a third (float32, 1 thread, ``[128, 432]`` to ``[256, 2048]``): the smaller
products and their concatenation cost what the symmetry saves. Off the CPU the blocks' launches
cost more still.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

# Measured on the host described above, inside the engine's steps (per-sample and per-task,
# each product timed in steps that alternate between the two routes): oneDNN's product paid
# from about 16 million multiply-adds ([128, 2048] Gramians: 0.59x; [128, 432]: 1.34x; near
# 8 million no whole step gained: [32, 9216] Gramians 0.81x in the step, but the CNN at B = 32
# 0.99x-1.01x, and three [256, 128] @ [128, 256] products made the MLP 256's step 1.02x-1.03x),
# with 8 rows and columns of the result at least (alone, 1.07x-7x slower below) and an inner
# size of 32 at least (alone, by slices: [1024, 32] @ [32, 1024] 0.86x, [512, 16] @ [16, 512]
# 1.28x).
ONEDNN_MIN_ROWS = 8
ONEDNN_MIN_INNER = 32
ONEDNN_MIN_WORK = 2**24
# Written into an `out=` by slices of at most this many elements (512 KB of float32): oneDNN's
# result is a new tensor, and a whole one came back from the system at every call, page faults
# included. For [1024, 256] @ [256, 1024]: 3.0-3.9 ms by slices of 64-256 rows against
# 5.0-5.7 ms whole (MKL: 5.4-5.5 ms), and 2-5 MB of peak memory against 11 MB (one process, 60
# products); in the steps, [1024, 64] @ [64, 1024] went from 1.07x MKL's time whole to 0.93x.
ONEDNN_SLICE_ELEMENTS = 2**17


def onednn_pays(vendor: str, capability: str, blas: str, has_onednn: bool) -> bool:
    """Whether a host's float32 products go through oneDNN: its BLAS is MKL, which takes its
    AVX2 code on a processor not made by Intel (``vendor``, as ``/proc/cpuinfo``'s
    ``vendor_id`` names it), while torch and oneDNN use the processor's AVX-512 (``capability``,
    ``torch.backends.cpu.get_cpu_capability()``).

    Example:
        >>> from jacflow.linalg._products import onednn_pays
        >>> onednn_pays("AuthenticAMD", "AVX512", "mkl", True)
        True
        >>> onednn_pays("GenuineIntel", "AVX512", "mkl", True)  # MKL takes AVX-512 there
        False
        >>> onednn_pays("AuthenticAMD", "AVX2", "mkl", True)  # both take AVX2
        False
    """
    return (
        has_onednn
        and blas == "mkl"
        and capability.startswith("AVX512")
        and vendor not in ("", "GenuineIntel")
    )


def _cpu_vendor() -> str:
    """The processor's vendor string (``AuthenticAMD``, ``GenuineIntel``, ...), or ``""`` where
    it cannot be read (the rule then keeps torch's product)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    processor = platform.processor()  # Windows: "... AuthenticAMD"
    for vendor in ("AuthenticAMD", "GenuineIntel", "HygonGenuine"):
        if vendor in processor:
            return vendor
    return ""


@functools.cache
def host_prefers_onednn() -> bool:
    """:func:`onednn_pays` for this process's host (read once). oneDNN's product counts as
    present when one small product through it is exact: the operator is private, and a torch
    build that lacks it or changed its signature keeps torch's product."""
    blas = "mkl" if torch.backends.mkl.is_available() else "other"
    capability = torch.backends.cpu.get_cpu_capability()
    return onednn_pays(_cpu_vendor(), capability, blas, _onednn_works())


def _onednn_works() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    # (small integers: the products are exact; built and multiplied outside the caller's
    # settings: a default dtype or device, a tracer's or a counter's mode)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        probe = torch.arange(12, dtype=torch.float32, device="cpu").reshape(3, 4)
        try:
            return torch.equal(onednn_product(probe, probe.T), torch.mm(probe, probe.T))
        except (AttributeError, RuntimeError, TypeError):  # (missing, or another signature)
            return False


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...) or forward-mode AD
    is active: oneDNN's product has no batching rule (a slow loop) and no forward derivative
    (the tangent would be lost, silently)."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if peek is not None and peek() is not None:
        return True
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


# (private functions of torch; a build without one of them keeps torch's product)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_is_compiling = getattr(torch.compiler, "is_compiling", None)


def _observed() -> bool:
    """Whether the product is being recorded or watched: ``torch.compile``, a dispatch or
    torch-function mode (``make_fx``, ``FlopCounterMode``, ...), ``torch.jit``'s tracer. They
    would record a private operator that has no derivative (a graph whose gradients are lost,
    silently) or not count it."""
    if _dispatch_modes is None or _function_modes is None or _is_compiling is None:
        return True
    return (
        bool(_is_compiling())
        or _dispatch_modes() > 0
        or bool(_function_modes())
        or torch.jit.is_tracing()
    )


def takes_onednn(a: Tensor, b: Tensor) -> bool:
    """Whether :func:`product` multiplies ``a`` ``[n, k]`` and ``b`` ``[k, p]`` with oneDNN
    (:func:`row_gramian`: ``b = a.T``)."""
    if not host_prefers_onednn():  # (cached: a host that keeps MKL pays nothing more here)
        return False
    # (then: no subclass (fake, distributed, masked tensors, fx proxies), no sparse layout)
    if type(a) is not Tensor or type(b) is not Tensor:
        return False
    if a.layout != torch.strided or b.layout != torch.strided or _observed():
        return False
    (n, k), p = a.shape, b.shape[1]
    return (
        a.device.type == "cpu"
        and a.dtype == b.dtype == torch.float32
        and min(n, p) >= ONEDNN_MIN_ROWS
        and k >= ONEDNN_MIN_INNER
        and n * k * p >= ONEDNN_MIN_WORK
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))  # no derivative
        and not _transformed()
        and not torch.is_autocast_enabled("cpu")
        and torch._C._get_mkldnn_enabled()  # (`torch.backends.mkldnn.flags(enabled=False)`)
    )


def onednn_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` by oneDNN's product (float32 on the CPU, with torch built with it).

    Example:
        >>> import torch
        >>> from jacflow.linalg._products import onednn_product
        >>> a, b = torch.randn(16, 300), torch.randn(300, 12)
        >>> torch.allclose(onednn_product(a, b), a @ b, rtol=1e-5, atol=1e-4)
        True
    """
    weight = b.T
    if not (weight.is_contiguous() or b.is_contiguous()):
        # (oneDNN reorders a weight that is neither row- nor column-major by a slow generic
        # path: a row-strided [512, 576] view, a group's slice of a ghost Gramian's inputs,
        # took 3 s against 1.8 ms dense, 1 thread; the copy costs k p of the n k p)
        weight = weight.contiguous()
    return torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], "")


def product(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` for ``a`` ``[n, k]`` and ``b`` ``[k, p]`` (written into ``out`` when given),
    by oneDNN where that pays (:func:`takes_onednn`; see the module's docstring), else by
    ``torch.mm``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._products import product
        >>> product(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]]))
        tensor([[11.]])
    """
    if takes_onednn(a, b) and (  # (else torch.mm's own checks of `out`)
        out is None or (out.dtype == a.dtype and out.shape == (a.shape[0], b.shape[1]))
    ):
        if out is None:
            return onednn_product(a, b)
        rows = max(ONEDNN_MIN_ROWS, ONEDNN_SLICE_ELEMENTS // b.shape[1])
        for start in range(0, a.shape[0], rows):
            out[start : start + rows].copy_(onednn_product(a[start : start + rows], b))
        return out
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def row_gramian(flat: Tensor) -> Tensor:
    """``flat @ flat.T`` for ``flat`` ``[rows, columns]`` (:func:`product`).

    Example:
        >>> import torch
        >>> from jacflow.linalg._products import row_gramian
        >>> row_gramian(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        tensor([[ 5., 11.],
                [11., 25.]])
    """
    return product(flat, flat.T)
