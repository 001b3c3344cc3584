"""`python -m tasks.tools.summary` (make run): what the pipeline produced and where, from its JSON outputs.

`render` is the text alone, from the records as dicts: the README's copy of the committed run's summary is
checked against it (tests/test_readme_summary.py), so the README cannot quote a stale record."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import read_json
from tasks.core.metrics import worst_class
from tasks.core.params import Params
from tasks.images.shards import QUARANTINE
from tasks.images.validation import unversioned_source


def _read(path: Path) -> Any:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise StageError(f"{path}: not there yet; run the pipeline first (make run, or dvc repro)") from None


def _worst_class_line(metrics: Mapping[str, Any]) -> str:
    """`  worst class   glyph_8: recall 0.5333 (balanced accuracy 0.8033)`; nothing for a record without classes."""
    worst = worst_class(metrics)
    if worst is None:
        return ""
    balanced = metrics.get("balanced_accuracy")
    both = "" if balanced is None else f" (balanced accuracy {balanced:.4f})"
    return f"  worst class   {worst[0]}: recall {worst[1]:.4f}{both}\n"


def render(params: Params, *, metrics: Mapping[str, Any], export: Mapping[str, Any], verdict: Mapping[str, Any],
           quarantine: Mapping[str, int], train_run: Mapping[str, Any], environment: Mapping[str, Any],
           timings: Mapping[str, Any]) -> str:  # fmt: skip
    """The summary `make run` prints, from the run's records (the dicts of the files it reads)."""
    paths = params.paths
    gate = verdict.get("summary") or ("PASS" if verdict["passed"] else "REGRESSION")
    recipe = train_run.get("recipe", {}).get("summary", "-")
    env_path = paths.environment_record("train")
    env = environment
    environment_line = (f"train {env.get('precision', '-')} on {env.get('device', '-')}, {env.get('threads', '-')} "
                        f"thread(s), torch {env.get('libraries', {}).get('torch', '-')} ({env_path})")  # fmt: skip
    q = export.get("onnx_int8")
    int8 = "not in export.formats" if q is None else (
        f"agreement with fp32 {q['agreement']:.4f}, accuracy drop {q['accuracy_drop']:+.4f}"
        + ("" if q["kept"] else " (refused by its gates)"))  # fmt: skip
    unversioned = "" if unversioned_source(params.data, paths.generated) is None else (
        " (not versioned: make add-data)")  # fmt: skip
    if timings.get("model", {}).get("onnx_sha256") != export["onnx_sha256"]:
        latency = (f"not measured for this model here: {paths.export_timings} is per machine, not part of the record "
                   "(dvc repro --force export measures it)")  # fmt: skip
    else:
        row = timings["latency_ms_median"].get("batch_1", {})
        latency = "batch 1, ms: " + ", ".join(f"{name} {ms:.2f}" for name, ms in row.items())
    return (
        "Pipeline finished\n"
        f"  data          {params.data.source}: {quarantine['accepted']} images accepted, "
        f"{quarantine['quarantined']} quarantined, {quarantine['ignored']} ignored{unversioned}\n"
        f"  recipe        {recipe}\n"
        f"  environment   {environment_line}\n"
        f"  test accuracy {metrics['accuracy']:.4f}  (macro F1 {metrics['macro_f1']:.4f}, "
        f"{metrics['num_samples']} test images)\n"
        f"{_worst_class_line(metrics)}"
        f"  ONNX parity   agreement {export['agreement']:.4f}, max |logit diff| {export['max_abs_diff']:.2e}\n"
        f"  INT8          {int8}\n"
        f"  latency       {latency}\n"
        f"  regression    {gate}\n"
        f"  model         {paths.model}, {paths.onnx}\n"
        f"  metrics       {paths.metrics} (dvc metrics show)\n"
        f"  plots         {paths.train_curves}, {paths.confusion_png}\n"
        f"  TensorBoard   make tensorboard  (logs in {paths.runs})"
    )


def _main(params: Params) -> None:
    paths = params.paths
    env_path = paths.environment_record("train")
    timings_path = paths.export_timings
    text = render(
        params,
        metrics=_read(paths.metrics),
        export=_read(paths.export_report),
        verdict=_read(paths.regression_json),
        quarantine=_read(paths.shards / QUARANTINE)["counts"],
        train_run=_read(paths.train_run),
        environment=read_json(env_path) if env_path.is_file() else {},
        timings=read_json(timings_path) if timings_path.is_file() else {},
    )
    print("\n" + text)


def main() -> None:
    stage_main("summary", _main)


if __name__ == "__main__":
    main()
