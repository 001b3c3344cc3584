"""make sweep: an Optuna study whose trials are DVC experiments, each in its own temporary copy, run as Prefect
tasks (flows/sweep_flow.py). space.py checks and samples the search space, study.py holds the study (journal,
lock, sampler, pruner, resume), scheduler.py runs the trials as tasks, trial.py runs one trial and prunes it,
cpus.py gives each running trial CPUs of its own, store.py keeps the MLflow store to one writer, seeds.py reruns
the best with other seeds, report.py and outcome.py compare the trials."""
