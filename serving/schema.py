"""The server's response bodies, as pydantic models: what /predict, /predict/batch, /reload and every error
return, and what the OpenAPI schema at /docs shows."""

from __future__ import annotations

from pydantic import BaseModel


class ClassProbability(BaseModel):
    index: int
    label: str
    probability: float


class ModelInfo(BaseModel):
    sha256: str
    source: str
    version: str


class ImagePrediction(BaseModel):
    file: str
    top_k: list[ClassProbability]
    top1_probability: float
    margin: float
    low_confidence: bool


class PredictResponse(BaseModel):
    model: ModelInfo
    prediction: ImagePrediction


class BatchResponse(BaseModel):
    model: ModelInfo
    predictions: list[ImagePrediction]


class ErrorBody(BaseModel):
    error: str
    detail: str


class WorkerProblem(BaseModel):
    pid: int
    sha256: str | None  # the model this worker serves (None: none loaded)
    reason: str


class ReloadResponse(BaseModel):
    status: str  # reloaded | unchanged (| failed | incomplete with a 500)
    model: ModelInfo | None  # what the workers serve now (most of them, when they differ)
    previous: ModelInfo | None  # what the answering worker served before
    generation: int  # this reload's number since the server started
    workers: dict[str, int]  # sha256 -> how many workers serve it, of those that carried out this reload
    failed: list[WorkerProblem]  # refused the new model: serve the previous one
    unreached: list[WorkerProblem]  # did not report within the wait


class ReloadError(ErrorBody):
    """A reload that not every worker carried out: reload_failed (each refused it) or reload_incomplete."""

    status: str | None = None
    model: ModelInfo | None = None
    previous: ModelInfo | None = None
    generation: int | None = None
    workers: dict[str, int] | None = None
    failed: list[WorkerProblem] | None = None
    unreached: list[WorkerProblem] | None = None
