"""What people watch: per-step TensorBoard scalars and histograms, and the end-of-run profile.

Wall-clock figures (step times, images/s, data wait) live here and in the TensorBoard run folder,
never in versioned outputs. Only the main process writes; elsewhere every call is a no-op.
"""

from __future__ import annotations

import logging
import resource
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

WAIT_ADVICE_SHARE = 0.10  # above this share of step time spent waiting for data, say what to do


class Telemetry:
    def __init__(self, log_dir: Path, *, enabled: bool, histogram_every: int, purge_step: int | None) -> None:
        self.directory = Path(log_dir)
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step) if enabled else None
        self.histogram_every = histogram_every
        self.wait = self.compute = 0.0
        self.images = self.steps = 0

    def step(
        self,
        step: int,
        *,
        loss: float,
        accuracy: float,
        grad_norm: float,
        lrs: dict[str, float],
        wait_s: float,
        compute_s: float,
        images: int,
    ) -> None:
        self.wait, self.compute = self.wait + wait_s, self.compute + compute_s
        self.images, self.steps = self.images + images, self.steps + 1
        if self.writer is None:
            return
        scalars = {
            "train/loss": loss,
            "train/accuracy": accuracy,
            "train/grad_norm": grad_norm,
            "perf/data_wait_ms": 1000 * wait_s,
            "perf/compute_ms": 1000 * compute_s,
            "perf/images_per_second": images / max(wait_s + compute_s, 1e-9),
            **{f"lr/{name}": lr for name, lr in lrs.items()},
        }
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image: torch.Tensor, step: int = 0) -> None:
        """One uint8 (3, H, W) image (a grid of a batch) under TensorBoard's Images tab."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step, dataformats="CHW")

    def count(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        """Weights and gradients every `histogram_every` steps (costly: keep N large)."""
        if self.writer is None or not self.histogram_every or step % self.histogram_every:
            return
        for name, p in model.named_parameters():
            self.writer.add_histogram(f"weights/{name}", p.detach().float().cpu(), step)
            if p.grad is not None:
                self.writer.add_histogram(f"grads/{name}", p.grad.detach().float().cpu(), step)

    def epoch(self, epoch: int, row: dict[str, Any]) -> None:
        if self.writer is not None:
            for key, value in row.items():
                if key != "epoch":
                    self.writer.add_scalar(f"epoch/{key}", value, epoch)

    def profile(self, *, num_workers: int, device_type: str) -> dict[str, Any]:
        """Share of step time spent waiting for data vs computing, and what to do when waiting dominates."""
        total = self.wait + self.compute
        share = self.wait / total if total else 0.0
        summary: dict[str, Any] = {
            "steps": self.steps,
            "ms_per_step": round(1000 * total / max(self.steps, 1), 2),
            "data_wait_share": round(share, 4),
            "compute_share": round(1 - share, 4) if total else 0.0,
            "images_per_second": round(self.images / total, 1) if total else 0.0,
            "advice": [],
        }
        if share > WAIT_ADVICE_SHARE:
            summary["advice"] = [
                f"raise train.num_workers (now {num_workers}) so batches are prepared while the model computes",
                "pin_memory is on for CUDA; keep the per-sample work in the loader to a crop and a flip",
                "move heavier per-sample work (decode, resize, colour conversion) into the preprocess stage",
            ]
            if device_type == "cuda":
                summary["advice"].append("on a GPU, a larger batch also amortises the per-step loader cost")
        log.info(
            "profile: %d steps, %.0f ms/step, data wait %.1f%% / compute %.1f%%, %.0f img/s",
            self.steps, summary["ms_per_step"], 100 * share, 100 * (1 - share), summary["images_per_second"],
        )  # fmt: skip
        for line in summary["advice"]:
            log.warning("profile advice: %s", line)
        if self.writer is not None:
            self.writer.add_text("profile", str(summary))
        return summary

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def memory_report(device: torch.device) -> str:
    if device.type == "cuda":
        gib = 1 << 30
        free, total = torch.cuda.mem_get_info(device)
        return (
            f"GPU memory: {torch.cuda.memory_allocated(device) / gib:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved, "
            f"peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB, "
            f"{free / gib:.2f} of {total / gib:.2f} GiB free"
        )
    return f"host memory: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB"
