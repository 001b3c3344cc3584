"""A layer trace: one batch forward and backward with hooks on every module, and the layers that look wrong.

For each module (by its name in `named_modules`): output shape, parameter count, activation mean, std and
share of exact zeros, and the norm of the gradient that flows back into its output; for each parameter,
its gradient norm. Flags, by name:

- dead_activation: every output value is 0 (a layer that passes nothing on);
- dead_gradient: a trainable parameter whose gradient is all 0 (it cannot learn);
- vanishing_gradient / exploding_gradient: a parameter's gradient norm below VANISH x, or above
  EXPLODE x, the median gradient norm of all parameters;
- nonfinite: a NaN or Inf in an output or a gradient.

Forward hooks on the modules, tensor hooks on their outputs for the backward pass (module backward hooks
refuse the in-place ops of torchvision's models). The trace runs on a copy of the model in training mode
(BatchNorm with batch statistics, as training sees it); the model itself is not changed and no
optimizer step is taken.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

VANISH = 1e-4
EXPLODE = 1e3
RULES = {
    "dead_activation": "every output value is exactly 0",
    "dead_gradient": "a trainable parameter's gradient is all 0",
    "vanishing_gradient": f"a parameter's gradient norm is below {VANISH:g} x the median over all parameters",
    "exploding_gradient": f"a parameter's gradient norm is above {EXPLODE:g} x the median over all parameters",
    "nonfinite": "NaN or Inf in the output or a gradient",
}


@dataclass
class LayerRow:
    name: str
    kind: str
    output_shape: list[int]
    parameters: int  # this module's own, not its children's
    mean: float
    std: float
    zeros: float  # share of output values that are exactly 0
    output_grad_norm: float | None
    grad_norms: dict[str, float] = field(default_factory=dict)  # parameter name (within the module) -> norm
    flags: list[str] = field(default_factory=list)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def trace(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> list[LayerRow]:
    """Rows in forward order (each module once, the first time it runs), flags filled in."""
    model = copy.deepcopy(model).train()
    rows: dict[str, LayerRow] = {}
    handles = []

    def forward_hook(name: str):  # noqa: ANN202 - a hook factory
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = _first_tensor(output)
            if out is None or name in rows:
                return
            values = out.detach().float()
            own = sum(p.numel() for p in module.parameters(recurse=False))
            finite = bool(torch.isfinite(values).all())
            rows[name] = LayerRow(
                name=name, kind=type(module).__name__, output_shape=list(out.shape), parameters=own,
                mean=float(values.mean()), std=float(values.std()) if values.numel() > 1 else 0.0,
                zeros=float((values == 0).float().mean()), output_grad_norm=None,
                flags=[] if finite else ["nonfinite"],
            )  # fmt: skip
            if out.requires_grad:  # the backward hook: the gradient that reaches this output
                out.register_hook(lambda grad, row=rows[name]: _record_grad(row, grad))

        return hook

    for name, module in model.named_modules():
        if name:  # the root is the whole model: its output is the logits, traced as the head's
            handles.append(module.register_forward_hook(forward_hook(name)))
    try:
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    _gradients(model, rows)
    return list(rows.values())


def _record_grad(row: LayerRow, grad: torch.Tensor) -> None:
    # A tensor hook registered before an in-place op on the tensor (ReLU(inplace), `out += identity`)
    # gets the gradient of the value the module returned, which is the one wanted here.
    if row.output_grad_norm is None:
        row.output_grad_norm = float(grad.detach().float().norm())
        if not math.isfinite(row.output_grad_norm) and "nonfinite" not in row.flags:
            row.flags.append("nonfinite")


def _gradients(model: torch.nn.Module, rows: dict[str, LayerRow]) -> None:
    norms: dict[str, float] = {}
    for full, param in model.named_parameters():
        if param.requires_grad:
            norms[full] = float(param.grad.detach().float().norm()) if param.grad is not None else 0.0
    finite = sorted(v for v in norms.values() if math.isfinite(v) and v > 0)
    median = finite[len(finite) // 2] if finite else 0.0
    for full, norm in norms.items():
        owner, _, short = full.rpartition(".")
        row = rows.get(owner)
        if row is None:
            continue
        row.grad_norms[short] = norm
        if not math.isfinite(norm):
            flag = "nonfinite"
        elif norm == 0:
            flag = "dead_gradient"
        elif median and norm < VANISH * median:
            flag = "vanishing_gradient"
        elif median and norm > EXPLODE * median:
            flag = "exploding_gradient"
        else:
            continue
        if flag not in row.flags:
            row.flags.append(flag)
    for row in rows.values():
        if row.zeros == 1.0 and "dead_activation" not in row.flags:
            row.flags.insert(0, "dead_activation")


def flagged(rows: list[LayerRow]) -> dict[str, list[str]]:
    return {row.name: row.flags for row in rows if row.flags}


def as_json(rows: list[LayerRow]) -> dict[str, Any]:
    return {"rules": RULES, "flagged": flagged(rows), "layers": [asdict(row) for row in rows]}


def table(rows: list[LayerRow]) -> str:
    """The trace as a fixed-width console table."""
    head = f"{'module':34} {'type':18} {'output':>18} {'params':>9} {'mean':>9} {'std':>9} {'zeros':>6} "
    head += f"{'grad out':>9} {'grad params':>11}  flags"
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(map(str, r.output_shape))
        grads = max(r.grad_norms.values()) if r.grad_norms else None
        lines.append(
            f"{r.name[:34]:34} {r.kind[:18]:18} {shape:>18} {r.parameters:9d} {r.mean:9.3g} {r.std:9.3g} "
            f"{r.zeros:6.1%} {_num(r.output_grad_norm):>9} {_num(grads):>11}  {', '.join(r.flags)}"
        )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
