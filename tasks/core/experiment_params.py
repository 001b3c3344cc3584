"""params.yaml's `tracking` (the MLflow table) and `sweep` (the Optuna study) sections. Only the gate declares
`tracking` (the experiment it logs to); no stage reads `sweep`, so changing it reruns nothing. The sweep checks
its space against params.yaml before any trial (flows/sweep/space.py): a key must name a value params.yaml has,
and both ends must be values that key takes."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_DATABASE_URL = re.compile(r"^[a-z][a-z0-9]*(\+[a-z0-9_]+)?://\S+$")  # SQLAlchemy's dialect[+driver]://...


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TrackingParams(_Section):
    enabled: bool = Field(
        True, description="false: no MLflow run is logged (a team on another tracker); DVC keeps the record"
    )
    experiment: str = Field("imagepipe", min_length=1, description="the MLflow experiment every run is logged to")
    registered_model: str = Field(
        "imagepipe", min_length=1, description="make promote registers the promoted ONNX here, alias `production`"
    )
    ui_port: int = Field(5000, ge=1, le=65535, description="make experiments: the MLflow UI on 127.0.0.1:<ui_port>")


class SearchRange(_Section):
    """A searched value: `low`..`high` (ints: an integer range; `log`: log scale), or `choices`."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[str | int | float | bool, ...] | None = None
    integer: bool = Field(False, description="set from low/high being whole numbers in params.yaml")

    @model_validator(mode="before")
    @classmethod
    def _kind(cls, raw: object) -> object:
        if isinstance(raw, dict) and "low" in raw and "high" in raw and "integer" not in raw:
            both = [raw["low"], raw["high"]]
            raw = {**raw, "integer": all(isinstance(v, int) and not isinstance(v, bool) for v in both)}
        return raw

    @model_validator(mode="after")
    def _shape(self) -> SearchRange:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either choices (a non-empty list) or low and high, not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (or choices)")
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        return self


class SweepParams(_Section):
    study: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]+$", description="runs/sweep/<study>.journal: same name resumes"
    )
    trials: int = Field(12, ge=1, description="trials in the study (make sweep TRIALS=...)")
    parallel: int = Field(1, ge=1, description="trials at once (make sweep PARALLEL=...); 1 on one 2-core machine")
    sampler_seed: int = Field(0, ge=0, description="TPE's seed: a sweep run one trial at a time is repeatable")
    pruner: Literal["median", "hyperband", "none"] = Field("median", description="on per-epoch validation accuracy")
    startup_trials: int = Field(3, ge=0, description="median: trials that finish before any is pruned")
    warmup_epochs: int = Field(2, ge=0, description="median: epochs every trial trains before it can be pruned")
    seeds: int = Field(1, ge=1, description="> 1: the best configurations rerun with this many seeds (mean, spread)")
    rerun_top: int = Field(2, ge=1, description="seeds > 1: how many of the best configurations rerun")
    space: dict[str, SearchRange] = Field(default_factory=dict, description="dotted params.yaml key -> range")
    storage: str = Field(
        "", description="empty: the journal runs/sweep/<study>.journal; a database URL (postgresql://user@host/db): "
        "Optuna's RDBStorage, shared by machines; its password from ~/.pgpass or PGPASSWORD, not params.yaml",
    )  # fmt: skip
    heartbeat_s: int = Field(60, ge=1, description="database storage: a trial silent 3 heartbeats is failed, retried")
    pool: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_.-]*$",
        description="empty: trials run here; a Prefect work pool: deployment sweep-trial/<pool>",
    )

    @model_validator(mode="after")
    def _where(self) -> SweepParams:
        if self.storage and not _DATABASE_URL.match(self.storage):
            raise ValueError(f"sweep.storage {self.storage!r} is not a database URL (postgresql://user@host:5432/db)")
        if self.pool and not self.storage:
            raise ValueError(f"sweep.pool {self.pool!r} needs sweep.storage: a database every machine reaches")
        return self
