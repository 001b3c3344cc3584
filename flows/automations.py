"""Crash detection: the automation that marks a flow run Crashed once its heartbeats stop.

A flow run sends a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (30 in prefect.yaml).
When the process running it dies (worker killed, machine gone, OOM), the heartbeats stop and, `within`
seconds after the last one, this automation moves the run from Running to Crashed instead of leaving
it Running forever. The pattern is Prefect's own (docs: "detect and respond to zombie flows").
`python -m flows.automations [--within SECONDS]` creates it, or updates it in place, on PREFECT_API_URL.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

AUTOMATION_NAME = "imagepipe: mark runs Crashed when their heartbeats stop"
DEFAULT_WITHIN_S = 90  # three missed heartbeats at 30 s
MIN_WITHIN_S = 31  # the shortest heartbeat interval Prefect allows is 30 s


def crash_automation(within_s: int = DEFAULT_WITHIN_S) -> Automation:
    if within_s < MIN_WITHIN_S:
        raise ValueError(f"--within {within_s}: must be at least {MIN_WITHIN_S} s (heartbeats come every >= 30 s)")
    return Automation(
        name=AUTOMATION_NAME,
        description=f"A flow run with no heartbeat or state change for {within_s} s is marked Crashed.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            # Any later event of the same run (a heartbeat, or a state change, whatever its name) keeps it alive.
            expect={"prefect.flow-run.*"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within_s} s: the process running this flow run died",
                # Not forced: the server refuses Crashed for a run already Completed or Failed, so a
                # heartbeat sent just after a run finished cannot turn it into a crash.
                force=False,
            )
        ],
    )


def ensure_crash_automation(within_s: int = DEFAULT_WITHIN_S) -> Automation:
    """Create the automation, or update the one of the same name: running this twice leaves one."""
    wanted = crash_automation(within_s)
    try:
        existing = Automation.read(name=AUTOMATION_NAME)
    except ValueError:
        return wanted.create()
    wanted.id = existing.id
    wanted.update()
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--within", type=int, default=DEFAULT_WITHIN_S, help="seconds without a heartbeat")
    args = parser.parse_args()
    try:
        automation = ensure_crash_automation(args.within)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"automation {automation.name!r} ({automation.id}): runs silent for {args.within} s are marked Crashed")


if __name__ == "__main__":
    main()
