"""The automations: crash detection (a flow run marked Crashed once its heartbeats stop), and the drift
notification (a regression-flow run that ends in its "Drift" or "DriftUnread" state sends a notification).

A flow run sends a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (30 in prefect.yaml).
When the process running it dies (worker killed, machine gone, OOM), the heartbeats stop and, `within`
seconds after the last one, this automation moves the run from Running to Crashed instead of leaving
it Running forever. The pattern is Prefect's own (docs: "detect and respond to zombie flows").
`python -m flows.automations [--within SECONDS] [--drift-notify BLOCK]` creates them, or updates them in
place, on PREFECT_API_URL. BLOCK names a Prefect notification block (Slack, email, Teams, a custom
webhook...) that the drift automation sends to; without it there is no drift automation.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.core import Block
from prefect.blocks.notifications import NotificationBlock
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from flows.drift import DRIFT_STATE, DRIFT_UNREAD_STATE

AUTOMATION_NAME = "imagepipe: mark runs Crashed when their heartbeats stop"
DRIFT_AUTOMATION_NAME = "imagepipe: notify when the nightly check finds drift"
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


def drift_automation(block_document_id: UUID) -> Automation:
    """A regression-flow run entering its Drift or DriftUnread state -> a notification through the block, naming
    the run and the state. (The name stays the one it had before DriftUnread, so updating it keeps one.)"""
    return Automation(
        name=DRIFT_AUTOMATION_NAME,
        description=f"A regression-flow run that ends in '{DRIFT_STATE}' (the served model's traffic drifted) or "
        f"'{DRIFT_UNREAD_STATE}' (its /drift could not be read on several runs in a row) sends a notification.",
        trigger=EventTrigger(
            # One event per state a run enters, named after the state: either name fires it.
            expect={f"prefect.flow-run.{DRIFT_STATE}", f"prefect.flow-run.{DRIFT_UNREAD_STATE}"},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "flow", "prefect.resource.name": "regression-flow"}
            ),  # fmt: skip
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(
                block_document_id=block_document_id,
                subject="imagepipe: the nightly drift check: {{ flow_run.state.name }}",
                body="{{ flow_run.name }} ({{ flow.name }}) ended in {{ flow_run.state.name }}: "
                "{{ flow_run.state.message }}. Its artifacts regression-flow-drift and "
                "regression-flow-drift-figure show what moved, or why the server was not read.",
            )
        ],
    )


def ensure_crash_automation(within_s: int = DEFAULT_WITHIN_S) -> Automation:
    """Create the automation, or update the one of the same name: running this twice leaves one."""
    return _ensure(crash_automation(within_s))


def ensure_drift_automation(block: str) -> Automation:
    """The drift automation sending to the notification block named `block` (ValueError, one line, if none)."""
    try:
        notifier = Block.load(block) if "/" in block else None  # the base class finds the block by its type slug
    except (ValueError, KeyError):
        notifier = None
    if not isinstance(notifier, NotificationBlock) or notifier._block_document_id is None:
        raise ValueError(f"--drift-notify {block!r}: no such notification block on this server; create one (e.g. "
                         "`prefect block create slack-webhook`) and name it as <block-type-slug>/<name>")  # fmt: skip
    return _ensure(drift_automation(notifier._block_document_id))


def _ensure(wanted: Automation) -> Automation:
    try:
        existing = Automation.read(name=wanted.name)
    except ValueError:
        return wanted.create()
    wanted.id = existing.id
    wanted.update()
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--within", type=int, default=DEFAULT_WITHIN_S, help="seconds without a heartbeat")
    parser.add_argument("--drift-notify", metavar="BLOCK", help="notification block (<type-slug>/<name>) for drift")
    args = parser.parse_args()
    try:
        automation = ensure_crash_automation(args.within)
        drift = ensure_drift_automation(args.drift_notify) if args.drift_notify else None
    except ValueError as exc:
        parser.error(str(exc))
    print(f"automation {automation.name!r} ({automation.id}): runs silent for {args.within} s are marked Crashed")
    if drift is not None:
        print(f"automation {drift.name!r} ({drift.id}): a nightly run with drift notifies {args.drift_notify}")


if __name__ == "__main__":
    main()
