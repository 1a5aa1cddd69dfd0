"""autogram speed and memory: jacflow's Gramian engine vs an SGD step vs TorchJD 0.18, one run.

Per-sample losses (IWRM, m = B): one step = zero grads + forward + JD update + ``SGD.step``,
on ``--models`` (default ``mlp256,mlp1024,cnn``; also ``transformer``, one encoder layer,
``lstm`` and ``gru``, a recurrent layer and a head, which TorchJD's autogram refuses, and
``custom``, a layer of the user's own between two Linear layers: an ``einsum`` over the
sequence, a ``tanh`` and a learned scale, which no closed form covers, so the engine takes its
generic rule, a ``vmap`` per sample with the checks it documents; ``gpt2`` and ``opt``,
2-layer Hugging Face GPT-2 and OPT of width 64 on 16 tokens with a linear head, which need
``transformers``).

* ``sgd``: ``cross_entropy(reduction="mean").backward()``;
* ``jacflow``: ``jacflow.autogram.Engine(model, batch_dim=0).backward(losses, UPGradWeighting())``
  (one activation-only backward, closed-form Gramian, book-keeping update);
* ``jacflow_route``: the same engine's ``compute_gramian`` (the graph kept) + ``UPGradWeighting``
  + ``losses.backward(weights)``: the route of docs/integrations.md, where a framework (Lightning,
  the Hugging Face Trainer) runs the backward; one ordinary backward more than ``jacflow``;
* ``tjd_autogram``: TorchJD ``autogram.Engine`` + ``compute_gramian`` + its ``UPGradWeighting`` +
  ``losses.backward(weights)`` (the same route with TorchJD's engine and weighting);
* ``tjd_autojac``: TorchJD ``autojac.backward(losses)`` + ``jac_to_grad(params, UPGrad())``.

Multi-task (m heads on a shared trunk, MSE): ``sgd`` = ``losses.sum().backward()``; ``jacflow`` =
per-task ``Engine(trunk, batch_dim=None)`` + ``mtl_gramian_step`` (heads get the plain gradient);
``tjd_mtl`` = TorchJD ``mtl_backward(losses, features)`` + ``jac_to_grad(trunk, UPGrad())``;
``tjd_autogram`` = TorchJD ``Engine(trunk, batch_dim=None)`` + ``losses.backward(weights)``;
``raw`` ("hand-written, no engine") = the same work as ``jacflow``'s step written out in plain
torch for this trunk (no hooks, checks or bookkeeping; the same ``.grad``): the floor of the
engine's approach on the host, which tells the engine's own cost from the approach's.

Timing: process CPU time (wall time between synchronisations with ``--device cuda``), 1 torch
thread, median of interleaved rounds (``_timing.py``). The
"weighting ms" column times jacflow's ``UPGradWeighting`` alone on the Gramian of the same
model and data (the UPGrad QP's share of the jacflow step; the rest is the Gramian engine), and
"jacflow without weighting" is ``(jacflow - weighting) / SGD``.
"jacflow, SGD alone" times jacflow again, interleaved with SGD only, in fresh processes (as a
user's training process runs it; the median of ``--processes`` of them, with their range and
the SGD time of the median process): in the four-way rounds, the TorchJD methods' allocations
of up to GBs change the heap and caches that the steps after them meet, which inflates the
small models' steps, while their large blocks raise glibc's dynamic thresholds for the whole
process, which spares every step its page faults (see ``--keep-heap``). Both are reported. The
two steps of a pair share one heap: which of them faults depends on both (an SGD time above
the four-way rounds' says that the SGD step did).
Memory: each (config, method) runs 3 steps in a fresh subprocess; we report the peak RSS of
those steps (VmHWM, reset through ``/proc/self/clear_refs`` right before them) minus the RSS just
before the first step (model, data and engine already built), in MB (``tracemalloc`` does not
see torch's allocations). With ``--device cuda`` it is the peak of
``torch.cuda.max_memory_allocated`` over 3 steps (in this process, after one warm-up step)
minus the memory allocated before them.

``--keep-heap`` makes glibc keep freed memory for reuse in this process, for every method
(``_timing.keep_heap``): without it, steps that free more than glibc's trim threshold at their
end fault in fresh pages at the next one, which the process CPU time counts.

Run: ``.venv/bin/python benchmarks/bench_autogram.py [--quick] [--no-memory | --memory-only]
[--only iwrm|mtl] [--models mlp256,cnn,transformer,custom,gpt2,opt] [--widths 256]
[--device cuda] [--keep-heap] [--processes 5]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import torchjd
from _timing import checked_device, interleaved_medians, keep_heap, setup
from torchjd import autogram as tjd_autogram
from torchjd import autojac as tjd_autojac
from torchjd.aggregation import UPGrad as TjdUPGrad
from torchjd.aggregation import UPGradWeighting as TjdUPGradWeighting

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine, mtl_gramian_step

Step = Callable[[], None]


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def transformer() -> nn.Module:
    """One post-norm encoder layer (width 128, 4 heads, 16 positions) and a linear head."""
    return nn.Sequential(
        nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(16 * 128, 10),
    )


class Custom(nn.Module):
    """A layer without a closed form in the engine: ``tanh(x @ W) * scale`` written as an
    ``einsum`` over ``[B, T, d]``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("btd,de->bte", x, self.weight)) * self.scale


def custom() -> nn.Module:
    """Linear 32 -> 128 per position, the custom layer, and a head on the 16 positions."""
    return nn.Sequential(nn.Linear(32, 128), Custom(128), nn.Flatten(), nn.Linear(16 * 128, 10))


class Recurrent(nn.Module):
    """A recurrent layer (64 -> 128) over 16 steps and a linear head on the last step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](64, 128, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class GPT2Classifier(nn.Module):
    """A 2-layer GPT-2 (width 64, 2 heads, vocabulary 50, 16 positions, no dropout; Hugging
    Face's, whose attention and MLP layers are its ``Conv1D``) and a linear head on the mean of
    its last hidden states; the positions expanded to the batch (see docs/getting-started.md)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=2,
            vocab_size=50,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.trunk, self.head = GPT2Model(config), nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        hidden = self.trunk(input_ids=ids, position_ids=positions).last_hidden_state
        return self.head(hidden.mean(1))


class OPTClassifier(nn.Module):
    """A 2-layer OPT (Hugging Face's, width 64, 2 heads, MLP width 128, vocabulary 50, 16
    positions, no dropout; its MLP and last LayerNorm of each layer run on the tokens flattened
    batch first, ``[B T, d]``) and a linear head on the mean of its last hidden states."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import OPTConfig, OPTModel

        config = OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=128,
            num_attention_heads=2,
            vocab_size=50,
            max_position_embeddings=18,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
        )
        self.trunk, self.head = OPTModel(config), nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(input_ids=ids).last_hidden_state.mean(1))


# per-sample models that TorchJD 0.18's autogram refuses (its engine rejects RNNBase modules)
RECURRENT = ("lstm", "gru")


def iwrm_problem(
    model_name: str, batch: int, device: str = "cpu"
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (seeded: the same initialisation every call), inputs and labels on ``device``."""
    torch.manual_seed(0)
    if model_name == "cnn":
        model, x = cnn(), torch.randn(batch, 3, 32, 32)
    elif model_name == "transformer":
        model, x = transformer(), torch.randn(batch, 16, 128)
    elif model_name in RECURRENT:
        model, x = Recurrent(model_name), torch.randn(batch, 16, 64)
    elif model_name == "custom":
        model, x = custom(), torch.randn(batch, 16, 32)
    elif model_name in ("gpt2", "opt"):
        model = GPT2Classifier() if model_name == "gpt2" else OPTClassifier()
        x = torch.randint(0, 50, (batch, 16))
    else:
        width = int(model_name.removeprefix("mlp"))
        model, x = mlp(width), torch.randn(batch, width)
    return model.to(device), x.to(device), torch.randint(0, 10, (batch,)).to(device)


def iwrm_steps(
    model_name: str, batch: int, methods: list[str], device: str = "cpu"
) -> dict[str, Step]:
    """Fresh model per method (same init), so that hooks of one never touch another."""
    steps: dict[str, Step] = {}
    for method in methods:
        model, x, y = iwrm_problem(model_name, batch, device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        steps[method] = _iwrm_step(method, model, x, y, opt)
    return steps


def _iwrm_step(
    method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer
) -> Step:
    params = list(model.parameters())
    if method == "sgd":

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    elif method == "jacflow":
        engine, weighting = Engine(model, batch_dim=0), UPGradWeighting()

        def step() -> None:
            opt.zero_grad()
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), weighting)
            opt.step()

    elif method == "jacflow_route":
        route_engine, route_weighting = Engine(model, batch_dim=0), UPGradWeighting()

        def step() -> None:
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            losses.backward(route_weighting(route_engine.compute_gramian(losses)))
            opt.step()

    elif method == "tjd_autogram":
        tengine, tweighting = tjd_autogram.Engine(model, batch_dim=0), TjdUPGradWeighting()

        def step() -> None:
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            weights = tweighting(tengine.compute_gramian(losses))
            losses.backward(weights)
            opt.step()

    else:
        aggregator = TjdUPGrad()

        def step() -> None:
            opt.zero_grad()
            tjd_autojac.backward(F.cross_entropy(model(x), y, reduction="none"))
            tjd_autojac.jac_to_grad(params, aggregator)
            opt.step()

    return step


def mtl_problem(
    width: int, batch: int, m: int, device: str = "cpu"
) -> tuple[nn.Module, nn.ModuleList, torch.Tensor, torch.Tensor]:
    """Trunk, heads (seeded: the same initialisation every call), inputs and targets."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.ReLU()]
    trunk, heads = nn.Sequential(*layers), nn.ModuleList([nn.Linear(width, 1) for _ in range(m)])
    x, y = torch.randn(batch, width), torch.randn(batch, m)
    return trunk.to(device), heads.to(device), x.to(device), y.to(device)


def mtl_steps(
    width: int, batch: int, m: int, methods: list[str], device: str = "cpu"
) -> dict[str, Step]:
    steps: dict[str, Step] = {}
    for method in methods:
        trunk, heads, x, y = mtl_problem(width, batch, m, device)
        params = [*trunk.parameters(), *heads.parameters()]
        opt = torch.optim.SGD(params, lr=1e-3)
        steps[method] = _mtl_step(method, trunk, heads, x, y, opt)
    return steps


def _head_losses(
    heads: nn.ModuleList, features: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    return [F.mse_loss(h(features).squeeze(1), y[:, i]) for i, h in enumerate(heads)]


def _mtl_step(
    method: str,
    trunk: nn.Module,
    heads: nn.ModuleList,
    x: torch.Tensor,
    y: torch.Tensor,
    opt: torch.optim.Optimizer,
) -> Step:
    def forward_list() -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = trunk(x)
        return features, _head_losses(heads, features, y)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        features, losses = forward_list()
        return features, torch.stack(losses)

    shared = list(trunk.parameters())
    if method == "sgd":

        def step() -> None:
            opt.zero_grad()
            forward()[1].sum().backward()
            opt.step()

    elif method == "jacflow":
        engine, weighting = Engine(trunk, batch_dim=None), UPGradWeighting()
        head_params = list(heads.parameters())

        def step() -> None:
            opt.zero_grad()
            mtl_gramian_step(forward()[1], engine, weighting, tasks_params=head_params)
            opt.step()

    elif method == "tjd_autogram":
        tengine, tweighting = tjd_autogram.Engine(trunk, batch_dim=None), TjdUPGradWeighting()

        def step() -> None:
            opt.zero_grad()
            losses = forward()[1]
            losses.backward(tweighting(tengine.compute_gramian(losses)))
            opt.step()

    elif method == "raw":
        return _hand_written_mtl_step(trunk, heads, x, y, opt)
    else:
        aggregator = TjdUPGrad()

        def step() -> None:
            opt.zero_grad()
            features, losses = forward_list()
            tjd_autojac.mtl_backward(losses, features)
            tjd_autojac.jac_to_grad(shared, aggregator)
            opt.step()

    return step


def _hand_written_mtl_step(
    trunk: nn.Module,
    heads: nn.ModuleList,
    x: torch.Tensor,
    y: torch.Tensor,
    opt: torch.optim.Optimizer,
) -> Step:
    """jacflow's per-task step written out in plain torch for this trunk of Linear + ReLU
    layers, with no engine (no hooks, checks or bookkeeping): the forward keeping each layer's
    input, one backward per head to the features, one backward of the m rows through the
    trunk by hand, the ghost Gramian of each layer, jacflow's ``UPGradWeighting`` and the
    weighted update. The floor of the engine's approach on the host."""
    linears = [module for module in trunk if isinstance(module, nn.Linear)]
    head_params = list(heads.parameters())
    weighting = UPGradWeighting()

    def step() -> None:
        opt.zero_grad()
        inputs, products, h = [], [], x
        for linear in linears:
            inputs.append(h)
            products.append(F.linear(h, linear.weight, linear.bias))
            h = torch.relu(products[-1])
        features = h.detach().requires_grad_()
        losses = _head_losses(heads, features, y)
        rows, head_grads = [], [torch.zeros_like(p) for p in head_params]
        for loss in losses:
            feature_grad, *grads = torch.autograd.grad(
                loss, [features, *head_params], allow_unused=True
            )
            rows.append(feature_grad)
            for total, grad in zip(head_grads, grads, strict=True):
                if grad is not None:  # (the other tasks' heads)
                    total += grad
        with torch.no_grad():
            m = len(rows)
            output_grad, layer_grads = torch.stack(rows), []
            for i in reversed(range(len(linears))):
                layer_grads.insert(0, output_grad * (products[i] > 0))
                if i:
                    output_grad = layer_grads[0] @ linears[i].weight
            gramian = x.new_zeros(m, m)
            for layer_input, grad in zip(inputs, layer_grads, strict=True):
                kernel = layer_input @ layer_input.T + 1  # (+ 1: the bias)
                gramian += (kernel @ grad).reshape(m, -1) @ grad.reshape(m, -1).T
        weights = weighting(gramian)
        with torch.no_grad():
            for linear, layer_input, grad in zip(linears, inputs, layer_grads, strict=True):
                weighted = torch.tensordot(weights, grad, 1)
                linear.weight.grad = weighted.T @ layer_input
                linear.bias.grad = weighted.sum(0)
            for param, grad in zip(head_params, head_grads, strict=True):
                param.grad = grad
        opt.step()

    return step


def weighting_ms(gramian: torch.Tensor, rounds: int) -> float:
    """Median time (ms) of jacflow's ``UPGradWeighting`` alone on the Gramian of a step: the
    share of the jacflow step that is the UPGrad QP (the rest is the engine)."""
    weighting = UPGradWeighting()
    return interleaved_medians(
        {"w": lambda: weighting(gramian)}, rounds=rounds, warmup=3, device=gramian.device
    )["w"]


def iwrm_gramian(model_name: str, batch: int, device: str = "cpu") -> torch.Tensor:
    model, x, y = iwrm_problem(model_name, batch, device)  # the same Gramian as the timed steps
    with Engine(model, batch_dim=0) as engine:
        return engine.compute_gramian(F.cross_entropy(model(x), y, reduction="none"))


def mtl_gramian(width: int, batch: int, m: int, device: str = "cpu") -> torch.Tensor:
    trunk, heads, x, y = mtl_problem(width, batch, m, device)
    with Engine(trunk, batch_dim=None) as engine:
        features = trunk(x)
        losses = [F.mse_loss(h(features).squeeze(1), y[:, i]) for i, h in enumerate(heads)]
        return engine.compute_gramian(torch.stack(losses))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _spec_steps(spec: dict[str, object], methods: list[str]) -> dict[str, Step]:
    device = str(spec["device"])
    if spec["kind"] == "iwrm":
        return iwrm_steps(str(spec["model"]), int(str(spec["batch"])), methods, device)
    width, batch, m = (int(str(spec[k])) for k in ("width", "batch", "m"))
    return mtl_steps(width, batch, m, methods, device)


def _one_method_steps(spec: dict[str, object]) -> Step:
    method = str(spec["method"])
    return _spec_steps(spec, [method])[method]


def pair_child(spec: dict[str, object]) -> None:
    """Runs in a fresh process: jacflow and SGD interleaved, prints their medians (ms)."""
    setup()
    steps = _spec_steps(spec, ["sgd", "jacflow"])
    rounds, device = int(str(spec["rounds"])), str(spec["device"])
    print(json.dumps(interleaved_medians(steps, rounds=rounds, warmup=3, device=device)))


def _run_child(spec: dict[str, object], keep: bool) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    if keep:
        command.append("--keep-heap")
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def alone_ratio(spec: dict[str, object], rounds: int, keep: bool, processes: int) -> str:
    """jacflow / SGD, the two interleaved in a fresh process (see the module's docstring): the
    median over ``processes`` such processes, and their range when there are several (one
    process's ratio moved by up to 10% from the next on a shared 2-core host); "-" with none."""
    if processes == 0:  # (on a GPU each fresh process spends seconds starting CUDA)
        return "-"
    runs = []
    for _ in range(processes):
        times = _run_child({**spec, "task": "pair", "rounds": rounds}, keep)
        runs.append((times["jacflow"] / times["sgd"], times["sgd"]))
    runs.sort()
    median, sgd = runs[len(runs) // 2]
    # (the SGD time shows when the two steps' allocations made the SGD step fault there)
    if processes == 1:
        return f"{median:.2f}x, SGD {sgd:.1f} ms"
    return f"{median:.2f}x ({runs[0][0]:.2f}-{runs[-1][0]:.2f}), SGD {sgd:.1f} ms"


def memory_child(spec: dict[str, object]) -> None:
    """Runs in a fresh process: 3 steps of one method, prints the peak RSS increase (MB).

    The peak-RSS counter (VmHWM) is reset through ``/proc/self/clear_refs`` just before the
    steps, so that import-time peaks do not mask the steps' own peak.
    """
    setup()
    step = _one_method_steps(spec)
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(3):
        step()
    peak = _status_kb("VmHWM")
    print(json.dumps({"delta_mb": max(0, peak - before) / 1024}))


def cuda_memory(spec: dict[str, object]) -> float:
    """In this process (the allocator's peak can be reset): the peak CUDA memory allocated over
    3 steps minus the memory allocated before them (MB), after one warm-up step that makes the
    gradients and the libraries' workspaces, which every method shares."""
    step = _one_method_steps(spec)
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before) / 2**20


def iwrm_methods(model_name: str, batch: int) -> list[str]:
    """The per-sample table's methods for this model and batch (TorchJD's autogram refuses
    recurrent layers; its autojac Jacobian of the wide MLP at B = 128 is 128 rows of 3M+
    parameters)."""
    methods = ["sgd", "jacflow", "jacflow_route"]
    methods += [] if model_name in RECURRENT else ["tjd_autogram"]
    wide = model_name.startswith("mlp") and int(model_name[3:]) >= 1024
    if not wide or batch <= 64:
        methods.append("tjd_autojac")
    return methods


def iwrm_spec(model_name: str, batch: int, device: str) -> dict[str, object]:
    """A per-sample configuration, as its child processes read it."""
    return {"kind": "iwrm", "model": model_name, "batch": batch, "device": device}


def iwrm_memory_row(model_name: str, batch: int, methods: list[str], device: str) -> list[str]:
    """Peak memory of SGD, jacflow and TorchJD's two routes (``-`` where not run), MB."""
    spec = iwrm_spec(model_name, batch, device)
    return [model_name, str(batch)] + [
        memory_cell({**spec, "method": m}) if m in methods else "-"
        for m in ("sgd", "jacflow", "tjd_autogram", "tjd_autojac")
    ]


def memory_cell(spec: dict[str, object]) -> str:
    """:func:`memory` in MB, or "fails" where the method raises (with ``--memory-only`` the
    methods are not tried first: TorchJD's autogram fails on OPT)."""
    try:
        return f"{memory(spec):.0f}"
    except subprocess.CalledProcessError:
        return "fails"


def memory(spec: dict[str, object]) -> float:
    if spec["device"] != "cpu":
        return cuda_memory(spec)
    return _run_child({**spec, "task": "memory"}, keep=False)["delta_mb"]


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    if not rows:
        return
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def drop_failing(steps: dict[str, Step]) -> set[str]:
    """Run each step once; drop (and name, with the error's first line) those that raise, e.g.
    TorchJD's autojac on cuDNN recurrent layers (no batching rule for their backward)."""
    failed = set()
    for name, step in list(steps.items()):
        try:
            step()
        except RuntimeError as error:
            print(f"{name} fails: {str(error).splitlines()[0]}", flush=True)
            failed.add(name)
            del steps[name]
    return failed


# the per-sample models that iwrm_problem builds by name (besides mlp<width>)
_NAMED_MODELS = ("cnn", "transformer", *RECURRENT, "custom", "gpt2", "opt")


def _known_model(name: str) -> bool:
    """Whether :func:`iwrm_problem` builds the per-sample model ``name``."""
    return name in _NAMED_MODELS or (name.startswith("mlp") and name.removeprefix("mlp").isdigit())


def _times_faster(ratio: float) -> str:
    """A ratio of TorchJD's time to jacflow's: two decimals below 10 (``1.24x``), whole above
    (``53x``)."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds and configurations")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--no-memory", action="store_true")
    memory.add_argument(
        "--memory-only",
        action="store_true",
        help="peak memory only, no timing (fresh processes: valid on a busy host)",
    )
    parser.add_argument("--only", choices=["iwrm", "mtl"], help="run one of the two parts")
    parser.add_argument(
        "--models", default="mlp256,mlp1024,cnn", help="per-sample models, comma-separated"
    )
    parser.add_argument("--widths", default="256,1024", help="multi-task widths, comma-separated")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--keep-heap", action="store_true", help="glibc keeps freed memory (see the docstring)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=5,
        help="fresh processes of the 'SGD alone' column (median, range; 1 with --quick; 0: none)",
    )
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.keep_heap:
        keep_heap()
    if args.child:
        spec = json.loads(args.child)
        (pair_child if spec["task"] == "pair" else memory_child)(spec)
        return
    device = checked_device(parser, args.device)
    for model_name in args.models.split(","):
        if not _known_model(model_name):
            parser.error(
                f"--models: unknown model {model_name!r}; known: mlp<width> (e.g. mlp256), "
                + ", ".join(_NAMED_MODELS)
            )
    setup()
    rounds = 5 if args.quick else (9 if device == "cpu" else 21)
    alone_rounds = 2 * rounds + 1  # (two cheap methods: more rounds for the same time)
    processes = min(1, args.processes) if args.quick else args.processes
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    name += ", glibc keeps freed memory" if args.keep_heap else ""
    print(f"torch {torch.__version__}, torchjd {getattr(torchjd, '__version__', '0.18')}, {name}")

    iwrm_rows, iwrm_mem = [], []
    models = [] if args.only == "mtl" else args.models.split(",")
    batches = [32, 64] if args.quick else [32, 64, 128]
    for model_name in models:
        for batch in batches:
            methods = iwrm_methods(model_name, batch)
            if not args.memory_only:  # (the timed table)
                steps = iwrm_steps(model_name, batch, methods, device)
                failed = drop_failing(steps)
                methods = [m for m in methods if m not in failed]
                times = interleaved_medians(steps, rounds=rounds, warmup=2, device=device)
                sgd = times["sgd"]
                ratio = {k: f"{v / sgd:.2f}x" for k, v in times.items()}
                ratio.update({k: "fails" for k in failed})
                qp = weighting_ms(iwrm_gramian(model_name, batch, device), 3 * rounds)
                spec = iwrm_spec(model_name, batch, device)
                alone = alone_ratio(spec, alone_rounds, args.keep_heap, processes)
                iwrm_rows.append(
                    [
                        model_name,
                        str(batch),
                        f"{sgd:.1f}",
                        f"{times['jacflow']:.1f}",
                        f"{qp:.1f}",
                        f"{(times['jacflow'] - qp) / sgd:.2f}x",
                        ratio["jacflow"],
                        alone,
                        ratio["jacflow_route"],
                        ratio.get("tjd_autogram", "refused"),
                        ratio.get("tjd_autojac", "-"),
                        _times_faster(times["tjd_autogram"] / times["jacflow"])
                        if "tjd_autogram" in times
                        else "-",
                    ]
                )
                print(iwrm_rows[-1], flush=True)
            if not args.no_memory:
                iwrm_mem.append(iwrm_memory_row(model_name, batch, methods, device))
                print(iwrm_mem[-1], flush=True)

    mtl_rows, mtl_mem = [], []
    widths = [int(w) for w in args.widths.split(",")]
    configs = [] if args.only == "iwrm" else [(w, {256: 64, 1024: 256}.get(w, 64)) for w in widths]
    ms = [2, 6] if args.quick else [2, 6, 10]
    for width, batch in configs:
        for m in ms:
            methods = ["sgd", "jacflow", "tjd_autogram", "tjd_mtl"]
            spec = {"kind": "mtl", "width": width, "batch": batch, "m": m, "device": device}
            if not args.memory_only:  # (the timed table)
                times = interleaved_medians(
                    mtl_steps(width, batch, m, [*methods, "raw"], device),
                    rounds=rounds,
                    warmup=2,
                    device=device,
                )
                sgd = times["sgd"]
                qp = weighting_ms(mtl_gramian(width, batch, m, device), 3 * rounds)
                alone = alone_ratio(spec, alone_rounds, args.keep_heap, processes)
                mtl_rows.append(
                    [str(width), str(batch), str(m), f"{sgd:.1f}", f"{qp:.2f}"]
                    + [f"{(times['jacflow'] - qp) / sgd:.2f}x", f"{times['jacflow'] / sgd:.2f}x"]
                    + [alone]
                    + [f"{times[k] / sgd:.2f}x" for k in methods[2:]]
                    + [f"{times['raw'] / sgd:.2f}x"]
                    + [f"{(m + 2) / 3:.2f}x", f"{1.25 * (m + 2) / 3:.2f}x"]
                )
                print(mtl_rows[-1], flush=True)
            if not args.no_memory:
                mtl_mem.append(
                    [str(width), str(batch), str(m)]
                    + [memory_cell({**spec, "method": k}) for k in methods]
                )
                print(mtl_mem[-1], flush=True)

    _table(
        f"Per-sample losses (m = B), {name} ms and ratios to the SGD step",
        [
            "model",
            "B",
            "SGD ms",
            "jacflow ms",
            "of which weighting ms",
            "jacflow without weighting",
            "jacflow",
            "jacflow, SGD alone",
            "jacflow, Gramian then backward",
            "TorchJD autogram",
            "TorchJD autojac",
            "autogram / jacflow",
        ],
        iwrm_rows,
    )
    _table(
        "Multi-task (shared trunk of 3 Linear+ReLU), ratios to the SGD step",
        [
            "width",
            "B",
            "m",
            "SGD ms",
            "weighting ms",
            "jacflow without weighting",
            "jacflow",
            "jacflow, SGD alone",
            "TorchJD autogram",
            "TorchJD mtl_backward",
            "hand-written, no engine",
            "floor (m+2)/3",
            "goal 1.25(m+2)/3",
        ],
        mtl_rows,
    )
    meter = "VmHWM, fresh process" if device == "cpu" else "CUDA allocator, after a warm-up step"
    if iwrm_mem:
        _table(
            f"Peak memory increase (MB, {meter}, 3 steps), per-sample",
            ["model", "B", "SGD", "jacflow", "TorchJD autogram", "TorchJD autojac"],
            iwrm_mem,
        )
    if mtl_mem:
        _table(
            "Peak memory increase (MB), multi-task",
            ["width", "B", "m", "SGD", "jacflow", "TorchJD autogram", "TorchJD mtl_backward"],
            mtl_mem,
        )


if __name__ == "__main__":
    main()
