"""The regression comparator: metrics vs a baseline under rules with direction, tolerance and a paired test. Pure.

A rule names a dotted key (`per_class.cat.recall`); `*` stands for every key at its level in the
baseline (`per_class.*.recall`: every class the baseline knows). `higher`/`lower` allow a worsening
of max(abs_tol, rel_tol x |baseline|); `equal` demands the same value (strings such as a hash, or
numbers within the tolerance). Anything missing or not finite fails: a gate never skips a rule.

Given both models' predictions on the same images (`Paired`: check_regression scores the baseline on today's
test set too), a worsening beyond the tolerance fails only when a one-sided paired test says it is not chance
(p < alpha), so that equal models do not fail by the luck of a few images:
- accuracy and per_class.<c>.recall are the fraction of a set of images classified right (all test images; those
  whose true class is c): McNemar's exact test on the images the two models disagree on, b = right by the baseline
  and wrong by the candidate, c = the reverse, p = P(X >= b) for X ~ Binomial(b + c, 1/2) (1 when b + c = 0).
  Such a rule whose set is too small to detect its tolerance at all (`judgeable`: even the smallest loss beyond
  the tolerance, k images, all of them discordant, gives p = 0.5^k >= alpha) says "too few images to judge"
  and does not fail the verdict, unless the loss it sees is beyond the tolerance and significant anyway.
- the other metrics of the confusion matrix (macro_f1, macro_precision, macro_recall, per-class precision and
  f1) are no fraction of one fixed set of images: a paired bootstrap over the test images (BOOTSTRAP_RESAMPLES
  resamples of both models' predictions together, a fixed seed, so the verdict is byte-stable), p = the share
  of resamples in which the candidate is not worse.
- anything else (loss, a hash) is compared on the tolerance alone, and the table says so.
Without per-image predictions (the nightly flow's comparison with baseline/metrics.json) every rule is judged on
its tolerance alone, as before.

The verdict also carries the export's deferred gates (INT8 vs fp32 ONNX): limits from params.yaml,
not a baseline, but a model whose INT8 copy fails them is not releasable either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from tasks.core.params import Rule
from tasks.release.parity import Check

Value = float | str

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
_EPS = 1e-12  # a worsening equal to the tolerance is within it, whatever the float rounding
_CHUNK = 4_000_000  # resampled images per bootstrap chunk: bounds memory on big test sets

MCNEMAR, BOOTSTRAP, TOLERANCE = "McNemar", "bootstrap", "tolerance only"


@dataclass(frozen=True)
class RuleResult:
    rule: str  # the rule as written (may hold *); `metric` is the concrete key it was checked on
    metric: str
    direction: str
    value: Value | None
    baseline: Value | None
    delta: float | None
    allowed: float | None
    passed: bool  # False: this row fails the verdict (a row too small to judge does not)
    reason: str
    n: int | None = None  # images the paired test ran on (None: no paired test)
    p_value: float | None = None  # one-sided p of "the candidate is worse" (two-sided for `equal`)
    test: str = ""  # McNemar | bootstrap | tolerance only; "" without per-image predictions
    judged: bool = True  # False: too few images to detect the tolerance, and no significant loss seen

    def describe(self) -> str:
        """One line a person can act on: the metric, its value, the baseline and the delta."""
        if self.delta is None:
            return f"{self.metric}: {self.reason} (value {_cell(self.value)}, baseline {_cell(self.baseline)})"
        return (
            f"{self.metric}: {_cell(self.value)} vs baseline {_cell(self.baseline)} "
            f"(delta {self.delta:+.4f}, {self.direction} is better, allowed {_cell(self.allowed)}): {self.reason}"
        )


@dataclass(frozen=True)
class Paired:
    """Both models' predicted class index for the same images, with the images' true class index, in one order
    (check_regression: today's test split, each model scored through the serving path)."""

    labels: Sequence[int]
    candidate: Sequence[int]
    baseline: Sequence[int]
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not len(self.labels) == len(self.candidate) == len(self.baseline):
            raise ValueError(f"paired predictions of unequal length: {len(self.labels)} labels, "
                             f"{len(self.candidate)} candidate, {len(self.baseline)} baseline")  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    passed: bool
    has_baseline: bool
    results: tuple[RuleResult, ...]
    gates: tuple[Check, ...] = ()
    mismatch: str = ""  # the baseline could not be compared on this run's test set: why, and what to do
    alpha: float | None = None  # the paired test's level; None: no per-image predictions, tolerance only
    baseline_note: str = ""  # how the baseline side was scored ("baseline re-scored on today's test set: ...")

    @property
    def status(self) -> str:
        """pass | regression | different test set | no baseline: one word for tables and dvc exp show."""
        if self.mismatch:
            return "different test set"
        if not self.passed:
            return "regression"
        return "pass" if self.has_baseline else "no baseline"

    @property
    def too_few(self) -> tuple[RuleResult, ...]:
        return tuple(r for r in self.results if not r.judged)

    def summary(self) -> str:
        """The verdict in one line a person can act on."""
        if self.mismatch:
            return self.mismatch
        note = f"; {self.baseline_note}" if self.baseline_note else ""
        if not self.passed:
            names = ", ".join(dict.fromkeys(r.metric if isinstance(r, RuleResult) else r.name for r in self.failures))
            return f"REGRESSION: {names} failed" + (" against the baseline" if self.has_baseline else "") + note
        if not self.has_baseline:
            return "no baseline yet: nothing to compare against; run `make promote` to make this run the baseline"
        held = len(self.results) - len(self.too_few)
        few = f" ({len(self.too_few)} more: too few images to judge)" if self.too_few else ""
        return f"PASS: {held} rule(s) and {len(self.gates)} export gate(s) hold against the baseline{few}{note}"

    @property
    def failures(self) -> tuple[RuleResult | Check, ...]:
        return tuple(r for r in (*self.results, *self.gates) if not r.passed)

    def with_gates(self, gates: Sequence[Check]) -> Verdict:
        """This verdict plus export gates: it passes only when they all pass too."""
        return replace(self, passed=self.passed and all(g.passed for g in gates), gates=tuple(gates))

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.status,
            "summary": self.summary(),
            "passed": self.passed,
            "has_baseline": self.has_baseline,
            "alpha": self.alpha,
            "baseline_note": self.baseline_note,
            "too_few_to_judge": [r.metric for r in self.too_few],
            "rules": [asdict(r) for r in self.results],
            "export_gates": [g.to_json() for g in self.gates],
        }


def lookup(metrics: Mapping[str, Any], dotted: str) -> Value | None:
    """metrics['per_class']['cat']['recall'] for 'per_class.cat.recall'; None when absent or not a leaf."""
    node: Any = metrics
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool):
        return None
    if isinstance(node, int | float):
        return float(node)
    return node if isinstance(node, str) else None


def expand(pattern: str, reference: Mapping[str, Any]) -> list[str]:
    """The concrete keys of `reference` that `pattern` matches (`*` = any one key), sorted."""
    keys = [""]
    for part in pattern.split("."):
        grown = []
        for prefix in keys:
            node = _node(reference, prefix)
            if not isinstance(node, Mapping):
                continue
            names = sorted(node) if part == "*" else [part] if part in node else []
            grown += [f"{prefix}.{name}" if prefix else name for name in names]
        keys = grown
    return keys


def _node(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split(".") if dotted else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


# -- the paired tests --------------------------------------------------------------------------------------------


def mcnemar_p(losses: int, gains: int, *, two_sided: bool = False) -> float:
    """McNemar's exact test: P(X >= losses) for X ~ Binomial(losses + gains, 1/2), the chance that models equal
    on these images disagree at least this much against the candidate (two-sided: in either direction)."""
    if losses + gains == 0:
        return 1.0
    from scipy.stats import binomtest  # here: importing scipy.stats costs half a second of every no-op repro

    alternative = "two-sided" if two_sided else "greater"
    return float(binomtest(losses, losses + gains, 0.5, alternative=alternative).pvalue)


def smallest_failing_loss(allowed: float, n: int) -> int:
    """The fewest images (net) a rule on a fraction of `n` images must lose to be worse than `allowed`."""
    return math.floor((allowed + _EPS) * n) + 1


def judgeable(allowed: float, n: int, alpha: float, *, two_sided: bool = False) -> bool:
    """Whether McNemar's test on `n` images can detect a loss beyond `allowed` at all: the smallest such loss,
    k images, all of them discordant (b = k, c = 0, the most significant way to lose them), reaches p < alpha.
    (With alpha 0.05 that takes k >= 5: a 0.05 tolerance needs 80 images, a 0.02 tolerance 200.)"""
    k = smallest_failing_loss(allowed, n)
    return k <= n and mcnemar_p(k, 0, two_sided=two_sided) < alpha


class _PairedStats:
    """The per-image arrays of a `Paired`, and the bootstrap's per-class counts, computed once per verdict."""

    def __init__(self, paired: Paired) -> None:
        self.labels = np.asarray(paired.labels, dtype=np.int64)
        self.predicted = {"candidate": np.asarray(paired.candidate, dtype=np.int64),
                          "baseline": np.asarray(paired.baseline, dtype=np.int64)}  # fmt: skip
        self.class_names = paired.class_names
        self._boot: dict[str, np.ndarray] | None = None

    def proportion_set(self, metric: str) -> np.ndarray | None:
        """The images a McNemar metric is the fraction of (a boolean mask), or None for other metrics."""
        if metric == "accuracy":
            return np.ones(len(self.labels), dtype=bool)
        parts = metric.split(".")
        if len(parts) == 3 and parts[0] == "per_class" and parts[2] == "recall" and parts[1] in self.class_names:
            return self.labels == self.class_names.index(parts[1])
        return None

    def mcnemar(self, mask: np.ndarray, direction: str) -> tuple[int, float]:
        """(images in the set, p) of McNemar's exact test of the candidate being worse on the images of `mask`."""
        right_c = self.predicted["candidate"][mask] == self.labels[mask]
        right_b = self.predicted["baseline"][mask] == self.labels[mask]
        lost, won = int(np.sum(right_b & ~right_c)), int(np.sum(right_c & ~right_b))
        if direction == "lower":  # a fraction right where lower is better: gaining images is the worsening
            lost, won = won, lost
        return int(mask.sum()), mcnemar_p(lost, won, two_sided=direction == "equal")

    def bootstrap_values(self, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The metric of (candidate, baseline) in each bootstrap resample, or None when the confusion matrix
        does not give it."""
        parts = metric.split(".")
        if metric in ("accuracy", "macro_precision", "macro_recall", "macro_f1"):
            name, index = metric.removeprefix("macro_"), None
        elif len(parts) == 3 and parts[0] == "per_class" and parts[1] in self.class_names and parts[2] in (
            "precision", "recall", "f1"):  # fmt: skip
            name, index = parts[2], self.class_names.index(parts[1])
        else:
            return None
        boot = self._bootstrap()
        values = []
        for model in ("candidate", "baseline"):
            true_pos, predicted, support = boot[f"{model}_tp"], boot[f"{model}_predicted"], boot["support"]
            if name == "accuracy":
                values.append(true_pos.sum(axis=1) / max(len(self.labels), 1))
                continue
            precision = np.divide(true_pos, predicted, out=np.zeros(true_pos.shape), where=predicted > 0)
            recall = np.divide(true_pos, support, out=np.zeros(true_pos.shape), where=support > 0)
            denom = precision + recall
            f1 = np.divide(2 * precision * recall, denom, out=np.zeros(true_pos.shape), where=denom > 0)
            per_class = {"precision": precision, "recall": recall, "f1": f1}[name]
            values.append(per_class.mean(axis=1) if index is None else per_class[:, index])
        return values[0], values[1]

    def _bootstrap(self) -> dict[str, np.ndarray]:
        """Per resample (BOOTSTRAP_RESAMPLES, classes): true positives and predictions per class of each model,
        and the support; both models are resampled on the same images."""
        if self._boot is not None:
            return self._boot
        n, classes = len(self.labels), max(len(self.class_names), 1)
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        counts: dict[str, list[np.ndarray]] = {}
        rows = max(1, _CHUNK // max(n, 1))
        for start in range(0, BOOTSTRAP_RESAMPLES, rows):
            size = min(rows, BOOTSTRAP_RESAMPLES - start)
            pick = rng.integers(0, n, size=(size, n)) if n else np.zeros((size, 0), np.int64)
            labels = self.labels[pick]
            counts.setdefault("support", []).append(_per_row_counts(labels, classes))
            for model, predicted in self.predicted.items():
                guess = predicted[pick]
                counts.setdefault(f"{model}_predicted", []).append(_per_row_counts(guess, classes))
                counts.setdefault(f"{model}_tp", []).append(_per_row_counts(labels, classes, guess == labels))
        self._boot = {key: np.concatenate(parts).astype(np.float64) for key, parts in counts.items()}
        return self._boot

    def bootstrap_p(self, metric: str, direction: str) -> float | None:
        """The share of resamples in which the candidate is not worse (with the +1 of a resampling p-value);
        `equal`: two-sided. None when the metric is not one of the confusion matrix."""
        values = self.bootstrap_values(metric)
        if values is None:
            return None
        delta = values[0] - values[1]
        total = len(delta) + 1
        if direction == "equal":
            return min(1.0, 2 * min((np.sum(delta <= 0) + 1) / total, (np.sum(delta >= 0) + 1) / total))
        worsening = -delta if direction == "higher" else delta
        return float((np.sum(worsening <= _EPS) + 1) / total)


def _per_row_counts(values: np.ndarray, classes: int, where: np.ndarray | None = None) -> np.ndarray:
    """(rows, n) class indices -> (rows, classes) counts of each class per row (only where `where`)."""
    rows = values.shape[0]
    flat = (values + (np.arange(rows) * classes)[:, None]).ravel()
    weights = None if where is None else where.ravel().astype(np.float64)
    return np.bincount(flat, weights=weights, minlength=rows * classes).reshape(rows, classes)


# -- one rule ----------------------------------------------------------------------------------------------------


def check_rule(
    rule: Rule,
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any],
    metric: str = "",
    *,
    stats: _PairedStats | None = None,
    alpha: float = 0.05,
) -> RuleResult:
    """Check one rule on one concrete key (`metric`, default: the rule's own key); with `stats`, a worsening
    beyond the tolerance fails only when the paired test finds it significant (p < alpha)."""
    metric = metric or rule.metric
    value, base = lookup(metrics, metric), lookup(baseline, metric)
    test = TOLERANCE if stats is not None else ""

    def result(delta: float | None, allowed: float | None, passed: bool, reason: str, **paired: Any) -> RuleResult:
        return RuleResult(rule.metric, metric, rule.direction, value, base, delta, allowed, passed, reason,
                          **{"test": test, **paired})  # fmt: skip

    if value is None or base is None:
        where = "this run's metrics" if value is None else "the baseline"
        return result(None, None, False, f"missing from {where}")
    if isinstance(value, str) or isinstance(base, str):
        if rule.direction != "equal":
            return result(None, None, False, "not a number; only direction 'equal' compares text")
        same = value == base
        return result(None, None, same, "ok" if same else "differs from the baseline")
    if not (math.isfinite(value) and math.isfinite(base)):
        return result(None, None, False, "not a finite number")
    allowed = round(max(rule.abs_tol, rule.rel_tol * abs(base)), 6)
    delta = value - base
    worsening = {"higher": -delta, "lower": delta, "equal": abs(delta)}[rule.direction]
    beyond = worsening > allowed + _EPS
    what = "differs" if rule.direction == "equal" else "worse"
    excess = f"{what} by {worsening:.6g}, more than the {allowed:.6g} allowed"
    if stats is None:
        return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")

    mask = stats.proportion_set(metric)
    if mask is not None:
        n, p = stats.mcnemar(mask, rule.direction)
        judged, paired = judgeable(allowed, n, alpha, two_sided=rule.direction == "equal"), {"test": MCNEMAR}
    else:
        n, p, judged, paired = len(stats.labels), stats.bootstrap_p(metric, rule.direction), True, {"test": BOOTSTRAP}
        if p is None:  # not a metric of the predictions (loss, a hash): the tolerance alone decides
            return result(round(delta, 6), allowed, not beyond, excess if beyond else "ok")
    paired.update(n=n, p_value=float(f"{p:.4g}"))
    if beyond and p < alpha:
        return result(round(delta, 6), allowed, False, f"{excess} (p {p:.2g} < alpha {alpha:g})", **paired)
    if not judged:
        return result(round(delta, 6), allowed, True, f"too few images to judge (n={n})", judged=False, **paired)
    if beyond:
        return result(round(delta, 6), allowed, True, f"{excess}, within chance (p {p:.2g} >= alpha {alpha:g})",
                      **paired)  # fmt: skip
    return result(round(delta, 6), allowed, True, "ok", **paired)


# -- the verdict -------------------------------------------------------------------------------------------------


def _test_set(metrics: Mapping[str, Any]) -> tuple[str, int, tuple[str, ...]]:
    """(test set hash, images, class names) of a metrics dict, as score_split and make promote write them."""
    per_class = metrics.get("per_class")
    classes = tuple(sorted(per_class)) if isinstance(per_class, Mapping) else ()
    return str(metrics.get("test_set_sha256")), int(metrics.get("num_samples") or 0), classes


def describe_test_set(metrics: Mapping[str, Any]) -> str:
    """`963 images, 10 classes (circle, crescent, ...), test set sha256 eb48cd1ff731` for a metrics dict."""
    digest, images, classes = _test_set(metrics)
    names = ", ".join(classes[:5]) + (f", ... ({len(classes) - 5} more)" if len(classes) > 5 else "")
    return f"{images} images, {len(classes)} classes ({names}), test set sha256 {digest[:12]}"


def mismatch(metrics: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    """For a baseline known only by its recorded metrics: empty when run and baseline were scored on the same test
    images and classes; else one line naming both and what to do. Rules compare models on one test set; across
    test sets they only produce a wall of `missing`/`differs` lines that say nothing about either model."""
    if "test_set_sha256" not in metrics or "test_set_sha256" not in baseline:
        return ""  # nothing says which test set: compared rule by rule
    ours, theirs = _test_set(metrics), _test_set(baseline)
    if ours[0] == theirs[0] and ours[2] == theirs[2]:
        return ""
    return (
        f"different test set: the baseline was scored on {describe_test_set(baseline)}; this run on "
        f"{describe_test_set(metrics)}. The rules compare models on the same test images: to gate models of this "
        f"data, promote one of them (`make promote`); to compare with the baseline, train on its data"
    )


def compare(
    metrics: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    rules: Sequence[Rule],
    *,
    paired: Paired | None = None,
    alpha: float = 0.05,
    baseline_note: str = "",
) -> Verdict:
    """Every rule checked; with no baseline at all the verdict passes and says so.

    With `paired` (both models' predictions on the same images, `baseline` the baseline's metrics on them), each
    rule also gets its paired test at level `alpha`. Without it, a baseline scored on another test set (or class
    set) fails as one `different test set` line instead of rule by rule."""
    if baseline is None:
        return Verdict(passed=True, has_baseline=False, results=())
    stats = _PairedStats(paired) if paired is not None else None
    if stats is None:
        different = mismatch(metrics, baseline)
        if different:
            return Verdict(passed=False, has_baseline=True, results=(), mismatch=different,
                           baseline_note=baseline_note)  # fmt: skip
    results: list[RuleResult] = []
    for rule in rules:
        keys = expand(rule.metric, baseline) if "*" in rule.metric else [rule.metric]
        if not keys:
            results.append(RuleResult(rule.metric, rule.metric, rule.direction, None, None, None, None, False,
                                      "matches nothing in the baseline"))  # fmt: skip
        results += [check_rule(rule, metrics, baseline, key, stats=stats, alpha=alpha) for key in keys]
    return Verdict(passed=all(r.passed for r in results), has_baseline=True, results=tuple(results),
                   alpha=alpha if stats is not None else None, baseline_note=baseline_note)  # fmt: skip


def _cell(x: Value | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x if len(x) <= 16 else x[:12] + "..."
    return f"{x:.4f}"


def _p_cell(p: float | None) -> str:
    return "-" if p is None else f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def _outcome(r: RuleResult) -> str:
    if not r.passed:
        return f"FAIL: {r.reason}"
    if not r.judged:
        return r.reason
    return "PASS" if r.reason == "ok" else f"PASS: {r.reason}"


def format_table(verdict: Verdict, *, markdown: bool = False) -> str:
    """The verdict as an aligned text table (or a Markdown table), one row per checked key; with a paired test,
    each row also gives its images (n), p-value and test."""
    outcome = "verdict: " + ("PASS" if verdict.passed else verdict.status.upper())
    if verdict.mismatch:
        sections = [verdict.mismatch]
    elif verdict.has_baseline:
        paired = verdict.alpha is not None
        header = ("metric", "value", "baseline", "delta", "allowed") + (("n", "p", "test") if paired else ())
        rows = [(*header, "result")]
        for r in verdict.results:
            cells = (f"{r.metric} ({r.direction})", _cell(r.value), _cell(r.baseline),
                     "-" if r.delta is None else f"{r.delta:+.4f}", _cell(r.allowed))  # fmt: skip
            extra = ("-" if r.n is None else str(r.n), _p_cell(r.p_value), r.test or "-") if paired else ()
            rows.append((*cells, *extra, _outcome(r)))
        sections = [verdict.baseline_note] if verdict.baseline_note else []
        sections.append(_table(rows, markdown))
        if paired:
            sections.append(
                f"a rule fails when it is worse than allowed and its paired test on the same images gives p < alpha "
                f"({verdict.alpha:g}); too few images to judge: even the smallest loss beyond the tolerance, every "
                "lost image a disagreement, could not reach p < alpha"
            )
    else:
        sections = ["no baseline yet: nothing to compare against (promote one with `make promote`)"]
    if verdict.gates:
        rows = [("export gate", "value", "limit", "params.yaml", "result")]
        for g in verdict.gates:
            rows.append((g.name, f"{g.value:.4f}", f"{g.op} {g.limit:g}", f"export.{g.param}",
                         "PASS" if g.passed else "FAIL"))  # fmt: skip
        sections.append(_table(rows, markdown))
    if markdown:
        return "\n\n".join([*sections, f"**{outcome}**"])
    return "\n\n".join(sections) + "\n" + outcome


def _table(rows: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
