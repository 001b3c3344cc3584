"""The layer trace: a layer forced to output zeros, a parameter cut off from the loss and a blown-up
gradient are flagged by name; a healthy model gets no flag; the tool runs on real shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.core.io import read_json
from tasks.core.params import Params
from tasks.tools import layer_trace
from tasks.training.models import build_model
from tasks.training.trace import flagged, table, trace
from tests.helpers.training import PARAMS, make_shards

pytestmark = pytest.mark.fast  # unit-level: make test-fast


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 32, 32, generator=generator), torch.arange(8) % 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("resnet18", 3)


def test_a_healthy_model_has_no_flags_and_every_module_is_traced() -> None:
    net = model()
    rows = trace(net, *batch())
    assert flagged(rows) == {}
    names = [row.name for row in rows]
    assert {"conv1", "layer2.0.conv1", "layer4.1.bn2", "fc"} <= set(names)
    fc = rows[names.index("fc")]
    assert fc.output_shape == [8, 3] and fc.parameters == 512 * 3 + 3 and set(fc.grad_norms) == {"weight", "bias"}
    assert all(row.output_grad_norm is not None and row.output_grad_norm > 0 for row in rows)
    assert net.fc.weight.grad is None  # the trace ran on a copy
    assert "layer2.0.conv1" in table(rows)


def test_a_layer_forced_to_zero_is_flagged_by_name() -> None:
    net = model()
    with torch.no_grad():
        net.layer2[0].conv1.weight.zero_()  # conv1 has no bias: its output is all zeros
    found = flagged(trace(net, *batch()))
    assert "dead_activation" in found["layer2.0.conv1"]
    assert "dead_activation" not in found.get("layer1.0.conv1", [])


def scale_gradient(factor: float):  # noqa: ANN201 - a forward hook: same output, gradient x factor
    return lambda module, args, out: out * factor - out.detach() * (factor - 1)


def test_dead_vanishing_and_exploding_gradients_are_flagged_by_name() -> None:
    net = model()
    net.layer3[0].bn1.register_forward_hook(lambda m, a, out: out.detach())  # nothing flows back through it
    found = flagged(trace(net, *batch()))
    assert "dead_gradient" in found["layer3.0.bn1"] and "dead_gradient" in found["layer3.0.conv1"]
    # On the first layer, so that the scaled gradient reaches no other parameter.
    for factor, flag in ((1e6, "exploding_gradient"), (1e-8, "vanishing_gradient")):
        net = model()
        net.conv1.register_forward_hook(scale_gradient(factor))
        found = flagged(trace(net, *batch()))
        assert found == {"conv1": [flag]}, factor


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("trace"))


def test_the_tool_traces_the_first_training_batch(shards: Path, tmp_path: Path) -> None:
    p = Params.model_validate({**PARAMS.model_dump(mode="json"), "paths": {"shards": str(shards),
                               "model": str(tmp_path / "none.pt"), "reports": str(tmp_path)}})  # fmt: skip
    found = layer_trace.run(p, batch=6, init=True, report=p.paths.inspect_report)
    report = read_json(p.paths.inspect_report)
    assert report["images"] == 6 and report["flagged"] == found == {}
    assert report["model"].startswith("a fresh resnet18") and set(report["rules"]) >= {"dead_activation"}
    assert report["layers"][0]["output_shape"][0] == 6
