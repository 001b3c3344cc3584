"""PNG plots rendered by the project (DVC's HTML plots load their charting library from a CDN)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tasks.core.calibration_error import Reliability  # noqa: E402
from tasks.core.io import atomic_file  # noqa: E402

# No software/date metadata: the same numbers give the same PNG bytes.
_PNG_METADATA = {"Software": None}


def _save(fig: plt.Figure, path: Path) -> None:
    with atomic_file(path) as handle:
        fig.savefig(handle, format="png", dpi=100, metadata=_PNG_METADATA)
    plt.close(fig)


def plot_history(history: Sequence[dict[str, float]], path: Path) -> None:
    """Loss and accuracy per epoch, train vs validation."""
    epochs = [row["epoch"] for row in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in history], "o-", label="train")
    ax_loss.plot(epochs, [r["val_loss"] for r in history], "o-", label="val")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.plot(epochs, [r["train_accuracy"] for r in history], "o-", label="train")
    ax_acc.plot(epochs, [r["val_accuracy"] for r in history], "o-", label="val")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_confusion(matrix: np.ndarray, class_names: Sequence[str], path: Path) -> None:
    """Row-normalised confusion matrix (rows: true class), with counts in the cells."""
    n = len(class_names)
    totals = matrix.sum(axis=1, keepdims=True).clip(min=1)
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * n, 0.8 + 0.6 * n))
    ax.imshow(matrix / totals, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), class_names, rotation=45, ha="right")
    ax.set_yticks(range(n), class_names)
    ax.set(xlabel="predicted", ylabel="true", title="confusion matrix (test)")
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if matrix[i, j]:
                    color = "white" if matrix[i, j] / totals[i, 0] > 0.5 else "black"
                    ax.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=7, color=color)
    fig.tight_layout()
    _save(fig, path)


def plot_image_grid(images: np.ndarray, captions: Sequence[str], path: Path, title: str, columns: int = 8) -> None:
    """uint8 (N, 3, H, W) images in a grid, each with its caption (class names, predictions)."""
    rows = max(1, -(-len(images) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(1.5 * columns, 1.75 * rows + 0.5), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if k < len(images):
            ax.imshow(np.transpose(images[k], (1, 2, 0)), interpolation="nearest")
            ax.set_title(captions[k], fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_per_class(per_class: dict[str, dict[str, float]], path: Path) -> None:
    """Precision and recall of each class, side by side (metrics.json's per_class, test split)."""
    names = list(per_class)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(2.0 + 0.55 * len(names), 3.8))
    for offset, key in ((-0.2, "precision"), (0.2, "recall")):
        bars = ax.bar(x + offset, [per_class[n][key] for n in names], width=0.4, label=key)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.set_xticks(x, names, rotation=45, ha="right")
    ax.set(ylim=(0, 1.08), ylabel="score", title="per-class precision and recall (test)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_lr_find(lrs: Sequence[float], losses: Sequence[float], smoothed: Sequence[float], suggestion: float | None,
                 path: Path) -> None:  # fmt: skip
    """The range test's loss against the learning rate (log scale), with the suggested rate marked."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lrs, losses, alpha=0.3, label="loss")
    ax.plot(lrs, smoothed, label="smoothed loss")
    if suggestion is not None:  # None: no clear suggestion (tasks/training/lr_range.py)
        ax.axvline(suggestion, color="tab:red", linestyle="--", label=f"suggested lr {suggestion:g}")
    ax.set_xscale("log")
    top = min(max(smoothed), 4 * min(smoothed)) if smoothed else 1
    ax.set(xlabel="learning rate", ylabel="training loss", title="learning-rate range test",
           ylim=(0, max(top, min(smoothed) + 1e-3) * 1.1))  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_reliability(panels: dict[str, Reliability], path: Path) -> None:
    """Reliability diagrams side by side (test split): per bin of top-1 probability, the accuracy against the
    mean confidence; a perfectly calibrated model lies on the diagonal. The numbers give each bin's images."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (title, bins) in zip(axes.flat, panels.items(), strict=True):
        edges = np.linspace(0, 1, bins.bins + 1)
        width = edges[1] - edges[0]
        filled = bins.counts > 0
        ax.bar(edges[:-1][filled], bins.accuracy[filled], width=width, align="edge", edgecolor="black",
               label="accuracy")  # fmt: skip
        gap_bottom = np.minimum(bins.accuracy, bins.confidence)[filled]
        ax.bar(edges[:-1][filled], np.abs(bins.confidence - bins.accuracy)[filled], bottom=gap_bottom, width=width,
               align="edge", color="tab:red", alpha=0.3, label="gap to confidence")  # fmt: skip
        for left, acc, count in zip(edges[:-1][filled], bins.accuracy[filled], bins.counts[filled], strict=True):
            ax.text(left + width / 2, min(acc, 0.93) + 0.02, str(int(count)), ha="center", fontsize=6)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set(xlim=(0, 1), ylim=(0, 1.05), xlabel="top-1 probability", ylabel="accuracy",
               title=f"{title}\nECE {bins.ece:.3f} ({bins.bins} bins)")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    _save(fig, path)
