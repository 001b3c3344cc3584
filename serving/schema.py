"""The server's response bodies, as pydantic models: what /predict, /predict/batch and every error
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
