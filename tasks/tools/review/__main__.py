"""`make review [INTO=<name>]`: the review page on 127.0.0.1:<serve.review_port> (params.yaml), printed at start
with the token every request needs (new at each start).

python -m tasks.tools.review               # the dataset data.source is in (data/raw/<name>), if any
python -m tasks.tools.review --into pets   # take in to data/raw/pets
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.params import Params
from tasks.tools.review.intake import restore_stale
from tasks.tools.review.items import list_items
from tasks.tools.review.state import open_review

log = logging.getLogger("tasks.tools.review")


def _main(params: Params) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.tools.review", description=__doc__.splitlines()[0])
    parser.add_argument("--into", help="the DVC-tracked dataset under data/raw/ that the take-in merges into")
    args = parser.parse_args()
    review = open_review(params, args.into)
    port = params.serve.review_port
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise StageError(f"port {port} on 127.0.0.1 is taken: free it or change serve.review_port")
    restore_stale(review)  # a take-in killed mid-merge left its images staged: back for review
    import uvicorn

    from tasks.tools.review.app import create_app

    app = create_app(review)
    dataset = f"takes in to {review.dataset.dest}" if review.dataset else (
        f"no DVC-tracked dataset to take in to (data.source is {params.data.source}): it labels, take-in waits for "
        f"`make add-data SRC={params.data.source} NAME=<name>`")  # fmt: skip
    log.info("the review page: http://127.0.0.1:%d%s?token=%s (Ctrl-C stops it)", port, app.state.base, app.state.token)
    log.info("%d image(s) in %s; %s; decisions logged to %s (by %s)", len(list_items(review)), review.review_dir,
             dataset, review.log.path, review.log.who)  # fmt: skip
    sys.stdout.flush()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    stage_main("review", _main)


if __name__ == "__main__":
    main()
