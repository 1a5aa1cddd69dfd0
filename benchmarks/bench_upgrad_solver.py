"""Time to UPGrad weights: jacflow's batched solver against TorchJD 0.18, 1 CPU thread.

For each m and each Gramian structure, times ``jacflow.aggregation.UPGradWeighting()(G)`` (the
default exact ``TorchProjector``) and ``torchjd.aggregation.UPGradWeighting()(G)`` (quadprog per
row, regularised by 1e-4) with interleaved repeats (median of the process CPU time, robust to
other processes on a shared machine; with one torch thread all the work runs in the calling
thread), and reports the error of the update ``|J^T (w - w_exact)|`` relative to the root mean
square gradient norm ``sqrt(trace(G) / m)``, computed from ``J`` (see ``update_error``; unlike the
weights, the update is unique on singular Gramians, and unlike ``|J^T w_exact|`` this scale does
not vanish when the projection is 0), of both against an exact solution (PDAS, exact to
rounding once its active set is right, certified by its KKT residual).

Gramians: ``gauss`` = J J^T with J Gaussian m x 4m; ``mlp`` = per-sample Gramian of a small MLP
classifier (20-64-64-10, 6 154 parameters) at initialisation; ``lowrank`` = J J^T with J
Gaussian m x m/2: more objectives than the rank, the degenerate case (non-unique weights, often
a dual cone reduced to 0) that the exact Lawson-Hanson fallback handles; ``digits`` = the
per-sample Gramian of the ``jacflow`` command's iwrm classifier at initialisation on its bundled
digits (real images: condition about 1e5 at m = 512, most pairs conflicting). The last two are
not in the default list (``--gramians lowrank digits``).

The Gramians are float64 unless ``--dtype float32`` (the engine's Gramians of a float32 model):
then both libraries get the float64 Gramian rounded to float32, and the errors are measured
against the exact weights of the float64 one (they include the rounding).

With ``--device cuda`` both get the Gramian on the GPU (TorchJD's solver copies it to the host
and its weights back) and the clock is wall time between synchronisations (``_timing.py``).

Usage::

    .venv/bin/python benchmarks/bench_upgrad_solver.py [--sizes 2 8 32] [--torchjd-max-m 512]
        [--device cuda] [--dtype float32] [--seeds 0 1 2 3]

``--seeds`` draws each Gramian with several seeds (a row each): the degenerate "lowrank" ones
differ much between seeds (a dual cone reduced to 0 with some, a thin one with others).

TorchJD at m = 512 takes about a minute per call: it is timed once there (and three times at
m = 256); ``--torchjd-max-m`` skips it above a size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import checked_device, clock

from jacflow.aggregation import UPGradWeighting
from jacflow.linalg import project_weights
from jacflow.linalg._pdas import kkt_residual, multiplier_scale, pdas_solve

torch.set_num_threads(1)


def gauss_jacobian(m: int, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, 4 * m, generator=gen, dtype=torch.float64)


def lowrank_jacobian(m: int, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, max(1, m // 2), generator=gen, dtype=torch.float64)


def mlp_jacobian(m: int, seed: int = 0) -> Tensor:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 20, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (m,), generator=gen)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(m, -1) for g in grads.values()], dim=1)


def digits_jacobian(m: int, seed: int = 0) -> Tensor:
    """The per-sample Jacobian of the ``jacflow`` command's iwrm classifier at its
    initialisation on ``m`` of its bundled digits (m <= 1797): real images, an ill-conditioned
    Gramian (condition about 1e5 at m = 512, most pairs conflicting)."""
    from jacflow.cli._data import load_digits
    from jacflow.cli._model import mlp_classifier

    torch.manual_seed(seed)
    images, labels = load_digits()
    model = mlp_classifier().double()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    x, y = images[:m].double(), labels[:m]
    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(m, -1) for g in grads.values()], dim=1)


def exact_weights(gramian: Tensor) -> tuple[Tensor, float]:
    """UPGrad weights with a full PDAS polish (no cost limit) and their KKT residual."""
    m = gramian.shape[0]
    u = torch.eye(m, dtype=torch.float64)[None] / m
    g = (gramian / gramian.trace())[None]
    c = multiplier_scale(g)
    v = project_weights(u, g, tol=1e-13) * m
    residual = kkt_residual(v, u * m, 2 * torch.bmm(v, g), c)
    polished, polished_residual = pdas_solve(u * m, g, v, max_iter=20, tol=1e-14)
    if float(polished_residual.max()) < float(residual.max()):  # PDAS cycles on degenerate G
        v, residual = polished, polished_residual
    return v[0].sum(0) / m, float(residual.max())


def update_error(weights: Tensor, exact: Tensor, jacobian: Tensor) -> float:
    """``|J^T (w - w_exact)| / sqrt(trace(G) / m)``, from the Jacobian: from the Gramian,
    ``sqrt(d^T G d)`` cannot read below about ``1e-8 |d|`` (the rounding of ``d^T G d``), which
    large weights of a singular Gramian (not unique, all optimal) reach."""
    d = weights.double().cpu() - exact
    return float((d @ jacobian).norm() / (jacobian.square().sum() / len(d)).sqrt())


def median_times(
    fns: dict[str, Callable[[], Tensor]], repeats: dict[str, int], now: Callable[[], float]
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for r in range(max(repeats.values())):
        for name, fn in fns.items():
            if r < repeats[name]:
                start = now()
                fn()
                times[name].append(now() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256, 512])
    parser.add_argument("--torchjd-max-m", type=int, default=512)
    parser.add_argument(
        "--gramians",
        nargs="+",
        default=["gauss", "mlp"],
        choices=["gauss", "mlp", "lowrank", "digits"],
    )
    parser.add_argument("--device", default="cpu", help="where the Gramian lies: cpu or cuda")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one row per seed of each Gramian (its name then reads kind/seed)",
    )
    args = parser.parse_args()
    checked_device(parser, args.device)
    dtype = getattr(torch, args.dtype)
    now = clock(args.device)
    from torchjd.aggregation import UPGradWeighting as TorchJDUPGradWeighting

    ours, theirs = UPGradWeighting(), TorchJDUPGradWeighting()
    makers = {
        "gauss": gauss_jacobian,
        "mlp": mlp_jacobian,
        "lowrank": lowrank_jacobian,
        "digits": digits_jacobian,
    }
    header = (
        "| m | Gramian | jacflow (ms) | TorchJD 0.18 (ms) | speed-up | jacflow err | TorchJD err |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    for m in args.sizes:
        for kind, seed in [(k, seed) for k in args.gramians for seed in args.seeds]:
            jacobian = makers[kind](m, seed)
            gramian = jacobian @ jacobian.T
            name = kind if args.seeds == [0] else f"{kind}/{seed}"
            exact, residual = exact_weights(gramian)
            reference = jacobian  # (float64, on the CPU: the errors are measured on it)
            assert residual < 1e-11, f"reference not converged: {residual}"
            gramian = gramian.to(args.device, dtype)
            fns: dict[str, Callable[[], Tensor]] = {"ours": lambda g=gramian: ours(g)}
            calls = 101 if m <= 32 else (15 if m <= 64 else 5)  # (TorchJD: fewer above 128)
            repeats = {"ours": calls}
            with_torchjd = m <= args.torchjd_max_m
            if with_torchjd:
                fns["torchjd"] = lambda g=gramian: theirs(g)
                repeats["torchjd"] = calls if m <= 128 else (3 if m <= 256 else 1)
                if m >= 512:  # a minute per call: no warm-up call, timed once
                    start = now()
                    w_theirs = theirs(gramian)
                    t_theirs = now() - start
                    del fns["torchjd"], repeats["torchjd"]
                else:
                    w_theirs = theirs(gramian)
            t = median_times(fns, repeats, now)
            if with_torchjd and m < 512:
                t_theirs = t["torchjd"]
            err_ours = update_error(ours(gramian), exact, reference)
            if with_torchjd:
                err_theirs = update_error(w_theirs, exact, reference)
                cols = f"{t_theirs * 1e3:.2f} | {t_theirs / t['ours']:.1f}x | "
                tail = f"{err_ours:.1e} | {err_theirs:.1e} |"
            else:
                cols, tail = "- | - | ", f"{err_ours:.1e} | - |"
            print(f"| {m} | {name} | {t['ours'] * 1e3:.2f} | {cols}{tail}", flush=True)


if __name__ == "__main__":
    main()
