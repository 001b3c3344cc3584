"""`make review`: the review page on 127.0.0.1 (FastAPI + Jinja2, offline) over the review folder (serve.review_dir).

Label, discard and undo by keyboard, fix label-error candidates inside the DVC-tracked dataset, take the labelled
images in (the add-data merge) and accept the gate's decision; every decision goes to an append-only log.
"""
