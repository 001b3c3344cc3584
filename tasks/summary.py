"""`python -m tasks.summary` (make run): what the pipeline produced and where, from its JSON outputs."""

from __future__ import annotations

from tasks.io import read_json
from tasks.params import load_params


def main() -> None:
    params = load_params()
    reports = params.paths.reports
    metrics = read_json(reports / "metrics.json")
    export = read_json(reports / "export.json")
    verdict = read_json(reports / "regression.json")
    quarantine = read_json(params.paths.shards / "quarantine.json")["counts"]
    gate = verdict.get("summary") or ("PASS" if verdict["passed"] else "REGRESSION")
    recipe = read_json(reports / "train_run.json").get("recipe", {}).get("summary", "-")
    q = export.get("onnx_int8")
    int8 = "not in export.formats" if q is None else (
        f"agreement with fp32 {q['agreement']:.4f}, accuracy drop {q['accuracy_drop']:+.4f}"
        + ("" if q["kept"] else " (refused by its gates)"))  # fmt: skip
    timings_path = reports / "export_timings.json"
    timings = read_json(timings_path) if timings_path.is_file() else {}
    if timings.get("model", {}).get("onnx_sha256") != export["onnx_sha256"]:
        latency = f"{timings_path}: missing or from another model (dvc repro --force export measures this one)"
    else:
        row = timings["latency_ms_median"].get("batch_1", {})
        latency = "batch 1, ms: " + ", ".join(f"{name} {ms:.2f}" for name, ms in row.items())
    print(
        "\nPipeline finished\n"
        f"  data          {params.data.source}: {quarantine['accepted']} images accepted, "
        f"{quarantine['quarantined']} quarantined, {quarantine['ignored']} ignored\n"
        f"  recipe        {recipe}\n"
        f"  test accuracy {metrics['accuracy']:.4f}  (macro F1 {metrics['macro_f1']:.4f}, "
        f"{metrics['num_samples']} test images)\n"
        f"  ONNX parity   agreement {export['agreement']:.4f}, max |logit diff| {export['max_abs_diff']:.2e}\n"
        f"  INT8          {int8}\n"
        f"  latency       {latency}\n"
        f"  regression    {gate}\n"
        f"  model         {params.paths.model}, {params.paths.onnx}\n"
        f"  metrics       {reports / 'metrics.json'} (dvc metrics show)\n"
        f"  plots         {reports / 'train_curves.png'}, {reports / 'confusion.png'}\n"
        f"  TensorBoard   make tensorboard  (logs in {params.paths.runs})"
    )


if __name__ == "__main__":
    main()
