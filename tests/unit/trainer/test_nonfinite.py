"""Non-finite values stop the run in one line, through the runs a user starts (in process): a target with
an overflowing layer (offline capture, online training), a NaN planted in a batch (the exact step,
the kept head, the last good checkpoint), `optim.skip_nonfinite`, and a run whose simulated
acceptance falls to 1.0 (optim.lr=1e6) says so. The step still reads nothing back."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conf.compose import compose_root
from conf.errors import UserError
from conf.files import sha256_file
from conf.schema import RootConfig
from data_prep.folders.store import CapturedDataset
from data_prep.prepare import prepare
from data_prep.states.capture import CaptureSpec, checked_capture, first_nonfinite
from heads.folder import load_head
from tests.support.runs import data_folder, tiny_run_config, user_error_line
from tests.support.syncs import assert_steps_never_sync, eagle3, samples
from tests.support.targets import build_overflowing_target
from trainer.batching import length_grouped_batches
from trainer.collapse import collapse, never_rose
from trainer.health import LOSS, Fault, NonFiniteWatch, sample_at
from trainer.loop import check_validation_capture
from trainer.train import run

OVERFLOW_LAYER = 3  # decoder layer 3 overflows: hidden_states[4] is the first infinite one


@pytest.fixture(scope="module")
def overflowing_target(tmp_path_factory, smol_tokenizer) -> Path:
    return build_overflowing_target(tmp_path_factory.mktemp("overflowing"), smol_tokenizer, OVERFLOW_LAYER)


def eagle3_run(target: Path, data: Path, run_dir: Path, *extra: str) -> RootConfig:
    return tiny_run_config("eagle3", target, data, run_dir, "data.draft_vocab_size=400", *extra)


def test_offline_capture_refuses_an_overflowing_layer(overflowing_target, chat_file, tmp_path):
    cache = tmp_path / "cache"
    cfg = eagle3_run(overflowing_target, chat_file, tmp_path / "run", f"data.cache_dir={cache}")
    line = user_error_line(lambda: prepare(cfg))
    want = f"the target's hidden states overflow: layer {OVERFLOW_LAYER + 1} (HF hidden_states index"
    assert want in line and "is non-finite at token 0 of sample " in line, line
    assert "set target.dtype=bfloat16" in line
    assert not [p for p in cache.iterdir() if (p / "manifest.json").exists()]  # no folder made


def test_online_training_stops_at_an_overflowing_layer(overflowing_target, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    online = ("data.hidden_states=online", "optim.max_steps=4")
    line = user_error_line(lambda: run(eagle3_run(overflowing_target, chat_file, run_dir, *online)))
    assert line.startswith("error: step 1: non-finite target hidden states (online capture): ")
    assert f"layer {OVERFLOW_LAYER + 1} (HF hidden_states index" in line
    assert "of the train split (" in line and "shard-00000.safetensors row " in line
    assert "no head kept yet, no checkpoint was written yet" in line
    assert not (run_dir / "head").exists() and not (run_dir / "checkpoints").exists()


@pytest.fixture(scope="module")
def data_cache(sharp_target, chat_file, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("nan")
    run(eagle3_run(sharp_target, chat_file, base / "run", "optim.max_steps=1"))
    return base / "data-cache"


def step_samples(cache: Path, steps: list[int]) -> list[int]:
    """The first training sample of each step's batch, as `tiny_run_args` batches (512 tokens,
    4 rows, seed 0, epoch 0)."""
    ds = CapturedDataset(data_folder(cache), "train")
    batches = length_grouped_batches(ds.lengths, 512, 4, seed=0, epoch=0)
    return [batches[step - 1][0] for step in steps]


def plant_nan(cache: Path, split: str, samples: list[int]) -> list[str]:
    """NaN hidden states in these samples of a split, the shards' checksums updated: data
    captured with a NaN, not damaged after. Returns the samples as errors name them."""
    folder = data_folder(cache)
    ds = CapturedDataset(folder, split)
    for i in samples:
        k, a, b = ds._index[i]
        with safe_open(str(ds.shards[k]), "pt") as f:
            meta = f.metadata()
        tensors = load_file(ds.shards[k])
        tensors["aux_hidden"][a:b] = float("nan")
        save_file(tensors, ds.shards[k], metadata=meta)
    manifest = json.loads((folder / "manifest.json").read_text())
    for shard in manifest["splits"][split]["shards"]:
        shard["sha256"] = sha256_file(folder / shard["file"])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return [ds.describe(i) for i in samples]


def nan_in_steps(data_cache: Path, tmp_path: Path, steps: list[int]) -> list[str]:
    shutil.copytree(data_cache, tmp_path / "data-cache")
    return plant_nan(tmp_path / "data-cache", "train", step_samples(tmp_path / "data-cache", steps))


STEPS = ("optim.max_steps=8", "optim.val_every=2", "optim.save_every=2")


def test_a_nan_in_a_batch_stops_at_its_step_keeping_the_best(data_cache, sharp_target, chat_file, tmp_path):
    first, _ = nan_in_steps(data_cache, tmp_path, [3, 5])
    run_dir = tmp_path / "run"
    line = user_error_line(lambda: run(eagle3_run(sharp_target, chat_file, run_dir, *STEPS)))
    # Read at step 4 (a logging step), named at the step it happened.
    assert line.startswith(f"error: step 3: non-finite training loss: {first} holds non-finite aux_hidden; ")
    assert f"the best head so far (step 2) stays in {run_dir / 'head'}" in line
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'step-0000002'}" in line
    assert "; to fix: delete the folder and build it again: rm -r " in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000002"]
    load_head(run_dir / "head", "eagle3")  # finite: load_head refuses a head that is not
    assert not (run_dir / "summary.json").exists()


def test_skip_nonfinite_skips_up_to_n_steps(data_cache, sharp_target, chat_file, tmp_path, capsys):
    first, second = nan_in_steps(data_cache, tmp_path, [3, 5])
    run_dir = tmp_path / "run"
    cfg = eagle3_run(sharp_target, chat_file, run_dir, *STEPS, "optim.skip_nonfinite=1")
    line = user_error_line(lambda: run(cfg))
    assert (
        f"step 3: non-finite training loss: {first} holds non-finite aux_hidden: optimizer step "
        "skipped (1 of optim.skip_nonfinite=1)"
    ) in capsys.readouterr().out
    assert line.startswith(f"error: step 5: non-finite training loss: {second} holds non-finite")
    assert ", after 1 skipped step(s); the run stopped: the best head so far (step " in line
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'step-0000004'}" in line
    losses = [h["loss"] for h in json.loads((run_dir / "history.json").read_text()) if "loss" in h]
    assert len(losses) == 2 and torch.isfinite(torch.tensor(losses)).all()  # steps 2 and 4
    state = json.loads((run_dir / "checkpoints" / "step-0000004" / "trainer_state.json").read_text())
    assert state["skipped"] == 1  # resume keeps the count

    two = (*STEPS, "optim.skip_nonfinite=2")
    summary = run(eagle3_run(sharp_target, chat_file, tmp_path / "run2", *two))
    assert summary["skipped_steps"] == 2 and summary["steps"] == 8


def test_a_nan_in_the_validation_data_stops_at_the_validation(data_cache, sharp_target, chat_file, tmp_path):
    shutil.copytree(data_cache, tmp_path / "data-cache")
    (sample,) = plant_nan(tmp_path / "data-cache", "validation", [0])
    run_dir = tmp_path / "run"
    line = user_error_line(lambda: run(eagle3_run(sharp_target, chat_file, run_dir, *STEPS)))
    want = f"error: step 2: non-finite validation loss: {sample} holds non-finite aux_hidden; "
    assert line.startswith(want), line
    assert "no head kept yet, no checkpoint was written yet; to fix: delete the folder" in line
    assert not (run_dir / "head").exists() and not (run_dir / "checkpoints").exists()


def test_acceptance_falling_to_one_is_said_in_log_and_summary(
    data_cache, sharp_target, chat_file, tmp_path, capsys
):
    shutil.copytree(data_cache, tmp_path / "data-cache")

    def train(run_dir: Path, max_steps: int, *extra: str) -> tuple[dict, str]:
        """The run's summary and what it printed (the head kept by the simulated figure)."""
        steps = ("optim.val_every=2", "optim.save_every=4", f"optim.max_steps={max_steps}",
                 "optim.select_by=simulated")
        summary = run(eagle3_run(sharp_target, chat_file, run_dir, *steps, *extra))
        return summary, capsys.readouterr().out

    diverged = tmp_path / "diverged"  # optim.lr=1e6 from the first step: never above 1.0
    summary, out = train(diverged, 4, "optim.lr=1e6")
    assert summary["acceptance_collapse"]["peak"] == 1.0
    assert "step 4: no validation's simulated acceptance length rose above 1.000" in out

    run_dir = tmp_path / "run"  # trains, then goes on at optim.lr=1e6
    summary, _ = train(run_dir, 4)
    assert summary["acceptance_collapse"] is None
    # 1e4: one step undoes the training, yet no gradient overflows (1e6 did on a Xeon with AMX,
    # where the guard then stopped the run at its non-finite gradient norm; 1e3 fell at step 8)
    summary, out = train(run_dir, 8, "optim.lr=1e4", "resume=true")
    fell = summary["acceptance_collapse"]
    assert fell["step"] == 6 and fell["sim_acceptance_length"] < 1.0005 < fell["peak"]
    assert summary["best_step"] <= 4 and summary["best_score"] == fell["peak"]
    assert f"step 6: simulated acceptance length fell to 1.000 (it was {fell['peak']:.3f}" in out
    assert fell["message"] in out


# ---- the pieces ------------------------------------------------------------------------------


def test_first_nonfinite_names_the_lowest_layer_at_a_real_position():
    layers = [torch.zeros(2, 5, 4) for _ in range(4)]
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert first_nonfinite(layers, keep).tolist() == [-1, -1, -1]
    layers[1][1, 4, 0] = float("inf")  # padding: not a real position
    layers[3][0, 0, 2] = float("nan")
    layers[2][1, 2, 1] = float("-inf")
    assert first_nonfinite(layers, keep).tolist() == [2, 1, 2]


def test_sample_at_padded_and_packed_rows():
    lengths = [5, 3, 4]
    assert sample_at([2, 0], 1, 4, lengths) == (0, 4)
    assert sample_at([[1, 2], [0]], 0, 3, lengths) == (2, 0)  # packed: 1 then 2 back to back
    assert sample_at([[1, 2], [0]], 0, 2, lengths) == (1, 2)


GATHER = SimpleNamespace(gather=lambda t: t)  # one process


def test_watch_names_the_first_step_and_skips_within_budget():
    watch = NonFiniteWatch("cpu", 0, check_grad_norm=True)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    assert watch.observe(one, one, None, True)
    assert watch.read(GATHER) is None
    assert watch.observe(nan, None, None, False)  # a NaN in the first micro-batch of step 2
    assert watch.observe(one, nan, None, True)
    assert watch.observe(one, nan, None, True)
    assert watch.read(GATHER) == Fault(step=2, micro=1, what=LOSS, layer=-1, row=-1, position=-1)

    skipping = NonFiniteWatch("cpu", 10, check_grad_norm=True, skip_budget=1)
    assert not skipping.observe(nan, nan, None, True)  # step 11: not taken
    assert skipping.take_skip().step == 11 and skipping.take_skip() is None
    assert skipping.read(GATHER) is None and skipping.skipped == 1
    fp16 = NonFiniteWatch("cpu", 0, check_grad_norm=False, skip_budget=1)  # the scaler's job
    assert fp16.observe(one, nan, None, True) and fp16.read(GATHER) is None


def test_collapse_after_having_been_above_one():
    history = [{"step": 2, "val": {"sim_acceptance_length": 1.0}}, {"step": 4, "loss": 3.0}]
    assert collapse(history, {"sim_acceptance_length": 1.0}, 6) is None
    assert never_rose(history)["peak"] == 1.0
    history.append({"step": 6, "val": {"sim_acceptance_length": 1.2}})
    assert never_rose(history) is None
    assert collapse(history, {"sim_acceptance_length": 1.1}, 8) is None
    fell = collapse(history, {"sim_acceptance_length": 1.0001}, 8)
    assert fell == {"step": 8, "sim_acceptance_length": 1.0001, "peak": 1.2, "peak_step": 6}


def test_validation_names_the_sample_whose_hidden_states_overflowed():
    cfg = compose_root(["+head=eagle3", "optim.batch_tokens=64", "optim.max_batch_size=2"])
    lengths = [10, 20, 30, 12, 25, 8]
    val_ds = SimpleNamespace(lengths=lengths, describe=lambda i: f"validation sample {i}")
    one = SimpleNamespace(num_processes=1, gather=lambda t: t)
    clean = torch.tensor([-1, -1, -1])
    check_validation_capture(one, [clean, clean], val_ds, cfg)  # nothing overflowed
    batch = length_grouped_batches(lengths, 64, 2, seed=cfg.seed, epoch=0)[1]
    with pytest.raises(UserError) as err:
        check_validation_capture(one, [clean, torch.tensor([4, 1, 2]), clean], val_ds, cfg)
    assert str(err.value) == (
        "validation: the target's hidden states overflow: layer 4 (HF hidden_states index, after 4 "
        f"decoder layers) is non-finite at token 2 of validation sample {batch[1]}; a float16 target "
        "overflows where bfloat16 and float32 do not: set target.dtype=bfloat16 (or float32)"
    )


@pytest.mark.usefixtures("single_thread")
def test_online_steps_with_the_overflow_check_never_sync(tiny_model, tmp_path):
    model = tiny_model
    torch.manual_seed(0)
    trainee, _ = eagle3(model)
    spec = CaptureSpec((2, 4, 5), model.config.num_hidden_layers, target_top=True)
    capture = partial(checked_capture, model, spec)
    assert_steps_never_sync(trainee, samples(model, ()), tmp_path, capture)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.skip_nonfinite=-1"], "optim.skip_nonfinite=-1: expected a number >= 0"),
        (["optim.skip_nonfinite=2", "dist=zero2"], "optim.skip_nonfinite=2: DeepSpeed takes the optimizer"),
    ],
)
def test_skip_nonfinite_settings_are_checked(overrides, expected):
    assert compose_root(["+head=eagle3"]).optim.skip_nonfinite == 0  # off by default
    with pytest.raises(UserError, match=expected):
        compose_root(["+head=eagle3", *overrides])
