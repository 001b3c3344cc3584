"""Placement: one stage of dvc.yaml on another machine, through a Prefect work pool of its own.

Four pieces: protocol.py (what both sides know), git.py (git helpers), send.py (train-flow's side:
the placed-stage task) and receive.py (the pool's side: the run-stage flow, prefect.yaml's
flows/placement/receive.py:run_stage_flow). The names train-flow and the tests use are here.
"""

from flows.placement.git import check_git_remote
from flows.placement.protocol import DEPLOYMENT, PlacementError, StageCrashed, check_dvc_remote, check_placement
from flows.placement.receive import run_stage_flow
from flows.placement.send import placed_stage

__all__ = [
    "DEPLOYMENT", "PlacementError", "StageCrashed", "check_dvc_remote", "check_git_remote", "check_placement",
    "placed_stage", "run_stage_flow",
]  # fmt: skip
