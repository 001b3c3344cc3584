"""The drift thresholds the server holds each statistic to, and where each came from.

A number in params.yaml serve.drift.<statistic> is used as it is; else the curve a + b / n that export
calibrated into the model's reference (tasks/release/drift_reference.py); else, for an older reference,
LEGACY_THRESHOLD. A drift verdict ends when every statistic is back under its recover level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.release.calibration import STATISTICS, curve
from tasks.release.drift_reference import Reference

OK, DRIFT, NOT_ENOUGH, NO_REFERENCE = "ok", "drift", "not enough data", "no reference"
RECOVER = 0.8  # after drift, "back" means every statistic under 0.8 x a fixed threshold (verdict and warning alike)
LEGACY_THRESHOLD = 0.25  # a reference without calibration (exported before it) and no threshold in params.yaml


@dataclass(frozen=True)
class Threshold:
    """A statistic's threshold as a function of the window's fill n: a + b / n (a PSI's sampling noise goes as
    1/n), through the calibrated points; a fixed threshold is b = 0. `source` says where it came from, and
    `recover` is the curve a drift verdict ends under (RECOVER x a fixed threshold)."""

    a: float
    b: float
    source: str
    recover: tuple[float, float] = (0.0, 0.0)

    def at(self, n: int) -> float:
        return self.a + self.b / max(n, 1)

    def recover_at(self, n: int) -> float:
        return self.recover[0] + self.recover[1] / max(n, 1)

    @classmethod
    def fixed(cls, value: float, source: str) -> Threshold:
        return cls(value, 0.0, source, (RECOVER * value, 0.0))

    @classmethod
    def calibrated(cls, points: Mapping[int, float], recover: Mapping[int, float], source: str) -> Threshold:
        return cls(*curve(points), source, curve(recover))


@dataclass(frozen=True)
class DriftThresholds:
    window: int
    min_predictions: int
    limits: Mapping[str, Threshold]

    @classmethod
    def fixed(cls, window: int, min_predictions: int, value: float, source: str = "fixed") -> DriftThresholds:
        return cls(window, min_predictions, {s: Threshold.fixed(value, source) for s in STATISTICS})

    @classmethod
    def resolve(cls, params: Any, reference: Reference | None) -> tuple[DriftThresholds, list[str]]:
        """The thresholds the server uses, and warnings to log: a number in params.yaml serve.drift.<statistic>
        is used as it is; else the reference's calibrated curve; else (an older reference) LEGACY_THRESHOLD."""
        limits, warnings = {}, []
        calibration = reference.calibration if reference else None
        for stat in STATISTICS:
            fixed = getattr(params, stat)
            if fixed is not None:
                limits[stat] = Threshold.fixed(float(fixed), f"fixed: params.yaml serve.drift.{stat}")
                if calibration is not None:
                    calibrated = Threshold.calibrated(calibration.thresholds[stat], calibration.recover[stat], "")
                    if fixed < calibrated.at(params.window):
                        level, rate = calibrated.at(params.window), calibration.false_alarm_rate
                        warnings.append(f"serve.drift.{stat} {fixed:g} is under the {level:.3g} that test-like "
                                        f"traffic reaches in {rate:g} of windows of {params.window}: expect false "
                                        "drift alarms; leave it empty to use the calibrated threshold")  # fmt: skip
            elif calibration is not None:
                rate = calibration.false_alarm_rate
                sizes = "/".join(map(str, sorted(calibration.thresholds[stat])))
                limits[stat] = Threshold.calibrated(calibration.thresholds[stat], calibration.recover[stat],
                                                    f"calibrated at export: false-alarm rate {rate:g} per window, "
                                                    f"windows of {sizes}")  # fmt: skip
            else:
                limits[stat] = Threshold.fixed(LEGACY_THRESHOLD, f"fixed {LEGACY_THRESHOLD}: the model's reference "
                                               "has no calibrated thresholds (exported before them); re-export to "
                                               "calibrate")  # fmt: skip
        if reference is not None and calibration is None and any(getattr(params, s) is None for s in STATISTICS):
            warnings.append(f"the drift reference has no calibrated thresholds (an older export): fixed "
                            f"{LEGACY_THRESHOLD} is used; re-export the model to calibrate them")  # fmt: skip
        if calibration is not None:
            wanted = {params.min_predictions, params.window}
            calibrated = set(next(iter(calibration.thresholds.values())))
            if calibration.false_alarm_rate != params.false_alarm_rate or wanted != calibrated:
                warnings.append(f"the drift thresholds were calibrated at export for false-alarm rate "
                                f"{calibration.false_alarm_rate:g} and windows {sorted(calibrated)}; serve.drift asks "
                                f"{params.false_alarm_rate:g} and {sorted(wanted)}: the calibrated ones are used "
                                "(interpolated in 1/n); re-export after changing serve.drift")  # fmt: skip
        return cls(params.window, params.min_predictions, limits), warnings

    def of(self, statistic: str, n: int) -> float:
        return self.limits[statistic].at(n)

    def exceeded(self, values: Mapping[str, float], n: int) -> list[str]:
        """The statistics over their thresholds at a window of n predictions."""
        return [s for s in STATISTICS if values[s] > self.of(s, n)]

    def recovered(self, values: Mapping[str, float], n: int) -> bool:
        """Every statistic back under the level that ends a drift verdict."""
        return all(values[s] <= self.limits[s].recover_at(n) for s in STATISTICS)

    @classmethod
    def of_report(cls, report: Mapping[str, Any]) -> DriftThresholds:
        """The thresholds a /drift report was judged by: its window's minimum and each statistic's curves and
        source (a merge of replicas judges their summed window by the same ones)."""
        window = report["window"]
        limits = {s: Threshold(*stat["curve"], stat.get("source") or "", tuple(stat.get("recover_curve") or (0, 0)))
                  for s, stat in report["statistics"].items()}  # fmt: skip
        return cls(window["size"], window["min_predictions"], limits)

    def verdict(self, n: int, drifting: bool) -> str:
        """A window of n predictions that is (or is not) in its drift state."""
        return NOT_ENOUGH if n < self.min_predictions else DRIFT if drifting else OK

    def judge(self, values: Mapping[str, float], n: int, alert: bool | None = None) -> tuple[str, dict[str, Any]]:
        """The verdict of a window of n predictions with these statistic values, and each statistic's entry of
        its /drift report. `alert`: the window's drift state, which ends only under the recover levels (the
        server's window keeps it); None, for a window with no history (replicas merged for one night): drift
        when a statistic is over its threshold now."""
        at = max(n, self.min_predictions)
        over = self.exceeded(values, at) if n >= self.min_predictions else []
        drifting = bool(over) if alert is None else alert
        verdict = self.verdict(n, drifting)
        statistics = {s: {"value": round(values[s], 4), "threshold": round(self.of(s, at), 4), "exceeded": s in over,
                          "recover": round(self.limits[s].recover_at(at), 4), "source": self.limits[s].source,
                          "curve": [self.limits[s].a, self.limits[s].b],
                          "recover_curve": list(self.limits[s].recover)}
                      for s in STATISTICS}  # fmt: skip
        return verdict, statistics
