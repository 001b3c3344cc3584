"""make sweep: an Optuna study whose trials are DVC experiments, each in its own temporary copy, run as Prefect
tasks (flows/sweep_flow.py). space.py checks and samples the search space, study.py holds the study (journal,
lock, sampler, pruner, resume), trial.py runs one trial and prunes it, report.py compares the trials."""
