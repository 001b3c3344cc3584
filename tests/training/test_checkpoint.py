"""Checkpoint files: atomic, NaN-free, weights_only, refused when made from other params or data;
RNG states round-trip; transfer-learning weights skip what does not fit and say so."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.core.errors import StageError
from tasks.core.params import TrainParams
from tasks.training.checkpoint import (
    FORMAT,
    Checkpointer,
    CheckpointError,
    capture_rng,
    load_init_weights,
    prune_runs,
    restore_rng,
)
from tasks.training.identity import RunIdentity, run_identity, stage_environment, train_code
from tasks.training.models import build_model

pytestmark = pytest.mark.fast  # unit-level: make test-fast

IDENTITY = RunIdentity("p" * 64, "d" * 64)


def payload(value: float = 1.0) -> dict:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": {"step": int(value)},
            "rng": capture_rng(torch.Generator().get_state())}  # fmt: skip


def test_save_and_load_round_trip_with_weights_only(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", IDENTITY)
    assert ckpt.load() is None
    ckpt.save(payload(2.0), is_best=True)
    loaded = ckpt.load()
    assert loaded["progress"] == {"step": 2} and loaded["params_sha256"] == IDENTITY.params_sha256
    assert torch.equal(loaded["model"]["weight"], torch.full((2, 3), 2.0) - 0.1 * 1.0)  # one SGD step on ones
    assert ckpt.best.read_bytes() == ckpt.last.read_bytes()
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["best.pt", "last.pt"]  # no temp files left
    torch.load(ckpt.last, weights_only=True)  # plain tensors and containers only


def test_best_stays_when_a_later_save_is_not_better(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, IDENTITY)
    ckpt.save(payload(1.0), is_best=True)
    best = ckpt.best.read_bytes()
    ckpt.save(payload(3.0), is_best=False)
    assert ckpt.best.read_bytes() == best and ckpt.load()["progress"] == {"step": 3}
    assert ckpt.load(ckpt.best)["progress"] == {"step": 1}


def test_nan_is_never_written_and_the_last_good_checkpoint_survives(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, IDENTITY)
    ckpt.save(payload(1.0), is_best=False)
    good = ckpt.last.read_bytes()
    bad = payload(1.0)
    bad["optimizer"]["state"][0]["momentum_buffer"][0, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.0\.momentum_buffer holds NaN/Inf"):
        ckpt.save(bad, is_best=True)
    bad = payload(1.0)
    bad["model"]["weight"][1, 2] = float("nan")
    with pytest.raises(CheckpointError, match=r"model\.weight holds NaN/Inf; .*last\.pt is the last good one"):
        ckpt.save(bad, is_best=True)
    assert ckpt.last.read_bytes() == good and not ckpt.best.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_other_params_or_data_are_refused_unless_starting_fresh(tmp_path: Path) -> None:
    Checkpointer(tmp_path, IDENTITY).save(payload(), is_best=True)
    with pytest.raises(CheckpointError, match=r"made from other params .*refusing to resume.*train\.resume: false"):
        Checkpointer(tmp_path, RunIdentity("q" * 64, "d" * 64)).load()
    with pytest.raises(CheckpointError, match=r"made from other data than this run \(data dddd\w* vs eeee"):
        Checkpointer(tmp_path, RunIdentity("p" * 64, "e" * 64)).load()
    fresh = Checkpointer(tmp_path, RunIdentity("q" * 64, "d" * 64))
    fresh.discard()
    assert fresh.load() is None and list(tmp_path.iterdir()) == []


def test_half_written_and_torn_files(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, IDENTITY)
    ckpt.save(payload(1.0), is_best=False)
    partial = tmp_path / ".last.pt.tmp-99999"  # what a kill during a save leaves
    partial.write_bytes(b"PK\x03\x04 half a zip")
    assert ckpt.load()["progress"] == {"step": 1}  # never picked up
    ckpt.save(payload(2.0), is_best=False)
    assert not partial.exists()  # cleaned before the next save
    ckpt.last.write_bytes(ckpt.last.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"last\.pt: cannot be loaded .*train\.resume: false"):
        ckpt.load()


def test_every_rng_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    loader = torch.Generator().manual_seed(4)
    ckpt = Checkpointer(tmp_path, IDENTITY)
    ckpt.save({**payload(), "rng": capture_rng(loader.get_state())}, is_best=False)

    def draws(gen: torch.Generator) -> list[float]:
        return [random.random(), float(np.random.rand()), float(torch.rand(())), float(torch.rand((), generator=gen))]

    expected = draws(loader)
    draws(loader)  # move every stream on
    state = restore_rng(ckpt.load()["rng"])
    assert draws(torch.Generator().set_state(state)) == expected


def test_run_identity_ignores_operational_params_only() -> None:
    def ident(**update: object) -> str:
        params = TrainParams().model_copy(update=update)
        return run_identity(params, seed=1, data_sha256="d", init_sha256=None, device_type="cpu").params_sha256

    base = ident()
    assert ident(num_workers=4) == ident(auto_batch=True) == ident(checkpoint_every_steps=7) == base
    assert ident(nonfinite="abort") == ident(threads=1) == ident(resume=False) == ident(compile=True) == base
    assert len({base, ident(lr=0.2), ident(epochs=7), ident(precision="fp32"), ident(nproc_per_node=2)}) == 5
    # What auto resolved to is part of it: a bf16 run never takes an fp32 run's checkpoint as its own.
    resolved = {run_identity(TrainParams(), seed=1, data_sha256="d", init_sha256=None, device_type="cpu",
                             precision=name).params_sha256 for name in ("fp32", "bf16")}  # fmt: skip
    assert len(resolved) == 2
    # So is the memory format: a channels_last run never finishes on a contiguous run's checkpoint.
    formats = {run_identity(TrainParams(), seed=1, data_sha256="d", init_sha256=None, device_type="cpu",
                            memory_format=name).params_sha256 for name in ("contiguous", "channels_last")}  # fmt: skip
    assert len(formats) == 2


def test_run_identity_covers_the_code_and_the_environment(tmp_path: Path) -> None:
    """A code change or another library, CPU or thread count is another run: its own folder, never resumed."""

    def ident(code: dict[str, str], env: dict[str, object]) -> RunIdentity:
        return run_identity(TrainParams(), seed=1, data_sha256="d", init_sha256=None, device_type="cpu",
                            code=code, environment=env)  # fmt: skip

    code = {"tasks/train.py": "a" * 32, "tasks/training/augment.py": "b" * 32}
    env = {"libraries": {"torch": "2.14.1", "numpy": "2.4.6"}, "cpu_capability": "AVX2", "threads": 2}
    base = ident(code, env)
    changed_code = ident({**code, "tasks/training/augment.py": "c" * 32}, env)
    changed_env = ident(code, {**env, "threads": 1})
    assert len({base.name, changed_code.name, changed_env.name}) == 3
    assert changed_code.params_sha256 == base.params_sha256 and changed_code.code_sha256 != base.code_sha256
    # A checkpoint of the other code, found in this run's folder, is refused by name.
    Checkpointer(tmp_path / "x", base).save(payload(), is_best=False)
    with pytest.raises(CheckpointError, match=r"made from other code than this run"):
        Checkpointer(tmp_path / "x", changed_code).load()
    # In its own folder, the new run finds no checkpoint and says which file made it another run.
    fresh = Checkpointer(tmp_path / changed_code.name, changed_code)
    assert fresh.load() is None
    why = fresh.other_run()
    assert why is not None and "code tasks/training/augment.py changed" in why and "x/last.pt" in why
    why_env = Checkpointer(tmp_path / changed_env.name, changed_env).other_run()
    assert why_env is not None and "environment threads changed" in why_env


def test_the_code_identity_is_what_the_process_loaded_and_the_environment_is_the_record(tmp_path: Path) -> None:
    """The identity's code is the project files this process loaded that train's deps cover, package
    __init__ files included; its environment is the train stage's own record, CPU flags and all: two machines
    that differ only by AMX are two runs."""
    import tasks.check_regression  # noqa: F401  (another stage's code, in the same process)
    import tasks.train  # noqa: F401  (what `python -m tasks.train` loads)
    from tests.helpers.project import ROOT

    code = train_code(ROOT)
    expected = {"tasks/__init__.py", "tasks/train.py", "tasks/training/__init__.py", "tasks/training/augment.py"}
    assert expected <= set(code)
    assert code["tasks/train.py"] == hashlib.md5((ROOT / "tasks/train.py").read_bytes()).hexdigest()
    assert "tasks/release/verdict.py" not in code  # loaded by other tests in this process, not train's code
    record = {"cpu": {"flags": ["avx512_bf16"], "torch_capability": "AVX512"}, "precision": "bf16", "threads": 2}
    (tmp_path / "a.json").write_text(json.dumps(record))
    amx = {**record, "cpu": {**record["cpu"], "flags": ["avx512_bf16", "amx_bf16"]}}
    (tmp_path / "b.json").write_text(json.dumps(amx))
    a, b = (run_identity(TrainParams(), seed=1, data_sha256="d", init_sha256=None, device_type="cpu", code=code,
                         environment=stage_environment(tmp_path / name)) for name in ("a.json", "b.json"))  # fmt: skip
    assert a.name != b.name and a.code_sha256 == b.code_sha256
    assert stage_environment(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(StageError, match=r"bad.json: not the environment stage's JSON"):
        stage_environment(tmp_path / "bad.json")


def test_init_weights_skip_mismatched_layers_and_list_them(tmp_path: Path) -> None:
    source = build_model("resnet18", 3)
    path = tmp_path / "source.pt"
    # DDP/compile prefixes are stripped, and model.pt, a checkpoint or a bare state dict all load.
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}}, path)
    target = build_model("resnet18", 5)
    info = load_init_weights(target, path)
    assert [s["name"] for s in info["skipped"]] == ["fc.weight", "fc.bias"]
    assert info["skipped"][0]["reason"] == "shape [3, 512] in the file, [5, 512] in the model"
    assert info["fresh"] == ["fc.weight", "fc.bias"] and len(info["sha256"]) == 64
    assert torch.equal(target.layer4[1].conv2.weight, source.layer4[1].conv2.weight)

    with pytest.raises(CheckpointError, match="does not exist"):
        load_init_weights(target, tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_init_weights(target, tmp_path / "junk.pt")
    torch.save(build_model("mobilenet_v3_small", 3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no layer of .* matches this model"):
        load_init_weights(target, tmp_path / "other.pt")


def test_prune_keeps_the_current_run_and_the_newest_others(tmp_path: Path) -> None:
    names = [f"{i:016x}" for i in range(1, 6)]  # run 1 oldest ... run 5 newest
    for age, name in enumerate(reversed(names)):
        folder = tmp_path / name
        folder.mkdir()
        for file in ("last.pt", "best.pt"):
            (folder / file).write_bytes(b"x")
            os.utime(folder / file, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    (tmp_path / "notes").mkdir()  # not a run folder
    foreign = tmp_path / f"{0xABC:016x}"  # named like a run, but holds something else too
    foreign.mkdir()
    (foreign / "last.pt").write_bytes(b"x")
    (foreign / "mine.txt").write_text("keep me")
    removed = prune_runs(tmp_path, keep=3, current=names[0])  # the current run is the oldest one
    assert sorted(p.name for p in removed) == [names[1], names[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], names[3], names[4], "notes", foreign.name])
    assert prune_runs(tmp_path, keep=0, current=names[0]) == []  # 0 keeps everything
    assert prune_runs(tmp_path / "absent", keep=1, current=names[0]) == []


def test_a_checkpoint_of_another_format_starts_the_run_fresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint an older version of the code wrote (format 1) cannot be resumed; it must not stop the rerun."""
    ckpt = Checkpointer(tmp_path, IDENTITY)
    ckpt.save(payload(1.0), is_best=False)
    old = torch.load(ckpt.last, weights_only=True)
    torch.save({**old, "format": 1}, ckpt.last)
    with caplog.at_level("WARNING", logger="tasks.training.checkpoint"):
        assert ckpt.load() is None
    assert f"a checkpoint of format 1, this code reads format {FORMAT}; starting this run fresh" in caplog.text
    torch.save({"weights": torch.ones(1)}, ckpt.last)  # not ours at all: refused, with the way out
    with pytest.raises(CheckpointError, match=r"not a checkpoint of this pipeline; delete it or set train.resume"):
        ckpt.load()
