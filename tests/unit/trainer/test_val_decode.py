"""Decoded validation (`optim.val_decode_prompts`, `optim.select_by`): on by default where the run
can decode, off in one line where it cannot; the evaluator's decoder measures the head in
training, and the kept head is the best decoded one even when that is not the last."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from conf.errors import UserError
from conf.kinds import MedusaConfig
from conf.schema import (
    DataConfig,
    DistConfig,
    LoggingConfig,
    OptimConfig,
    RootConfig,
    TargetConfig,
    derive,
)
from heads.medusa.model import MedusaHead
from tests.support.targets import TINY
from trainer.checkpoint import STATE_FILE
from trainer.decoding import Chain, OracleDrafter
from trainer.distributed import build_accelerator
from trainer.kinds.medusa import MedusaTrainee
from trainer.loop import FitReport, fit
from trainer.selection import DECODED, chosen_by, kept_validation, selection_score
from trainer.val_decode import (
    ValDecoder,
    acceptance_se,
    build_val_decoder,
    decoder_or_off,
    prompt_ids,
    resolve_decoding,
    spread,
)

VOCAB = 256


def test_prompts_are_what_precedes_the_answer_spread_over_the_split():
    item = {"input_ids": torch.arange(10, 20), "loss_mask": torch.arange(10) >= 4}
    assert prompt_ids(item).tolist() == [10, 11, 12, 13]
    assert spread(10, 3) == [0, 4, 9] and spread(2, 5) == [0, 1] and spread(7, 1) == [0]


def test_selection_reads_the_chosen_metric():
    metrics = {"score": 1.4, DECODED: 1.2}
    assert selection_score(metrics, "simulated") == 1.4
    assert selection_score(metrics, "decoded") == 1.2
    assert selection_score({}, "decoded") is None  # no validation data: the latest is kept
    assert chosen_by("auto", True) == "decoded" and chosen_by("auto", False) == "simulated"
    assert chosen_by("simulated", True) == "simulated"


ZERO3 = DistConfig(strategy="deepspeed", zero_stage=3)


@pytest.mark.parametrize(
    ("cfg", "prompts", "by", "off"),
    [
        (RootConfig(), 8, "decoded", None),  # the default: decoded, and the head kept by it
        (RootConfig(optim=OptimConfig(select_by="simulated")), 8, "simulated", None),
        (RootConfig(optim=OptimConfig(val_decode_prompts=0)), 0, "simulated", None),  # the user's choice
        (RootConfig(dist=ZERO3), 0, "simulated", "ZeRO-3 partitions"),
        (RootConfig(data=DataConfig(val_fraction=0.0)), 0, "simulated", "data.val_fraction=0"),
        (RootConfig(target=TargetConfig(device_map="auto")), 0, "simulated", "target.device_map=auto"),
    ],
)
def test_the_default_decodes_where_the_run_can_and_says_where_not(cfg, prompts, by, off):
    """`optim.val_decode_prompts=null`: 8 prompts unless the run cannot decode (ZeRO-3 partitions
    the head, no validation split, a target split over devices), then off in one line that keeps
    the head by the simulated figure; an explicit value is the user's and is never second-guessed."""
    resolved, line = resolve_decoding(cfg)
    assert (resolved.optim.val_decode_prompts, resolved.optim.select_by) == (prompts, by)
    assert (line is None) is (off is None)
    if off is not None:
        assert off in line and "simulated" in line and "\n" not in line


def test_a_budget_that_prices_it_over_its_share_turns_the_default_off():
    cfg = RootConfig(budget="20m")
    resolved, line = resolve_decoding(cfg, planned=0)
    assert resolved.optim.val_decode_prompts == 0 and resolved.optim.select_by == "simulated"
    assert "the plan has no room for even 4 prompts in 15% of budget=20m" in line
    assert resolve_decoding(cfg, planned=8)[0].optim.val_decode_prompts == 8
    fitted, line = resolve_decoding(cfg, planned=5)  # the plan fitted fewer prompts to the share
    assert (fitted.optim.val_decode_prompts, fitted.optim.select_by, line) == (5, "decoded", None)
    chosen = RootConfig(budget="20m", optim=OptimConfig(val_decode_prompts=4))  # the user's: kept
    assert resolve_decoding(chosen, planned=0) == (derive(chosen, {"optim.select_by": "decoded"}), None)


def test_selecting_by_decoding_where_nothing_decodes_is_refused():
    with pytest.raises(UserError, match=r"^optim\.select_by='decoded': .*ZeRO-3.*optim\.select_by=simulated"):
        RootConfig(dist=ZERO3, optim=OptimConfig(select_by="decoded"))
    with pytest.raises(UserError, match=r"^optim\.val_decode_prompts=2: rank 0 decodes .*ZeRO-3"):
        RootConfig(dist=ZERO3, optim=OptimConfig(val_decode_prompts=2))


def test_the_kept_validation_names_both_figures():
    history = [{"step": 2, "loss": 3.0}, {"step": 2, "val": {"sim_acceptance_length": 1.8, DECODED: 1.4}},
               {"step": 4, "val": {"sim_acceptance_length": 1.9}}]
    assert kept_validation(history, 2) == {"step": 2, "simulated": 1.8, "decoded": 1.4}
    assert kept_validation(history, 4) == {"step": 4, "simulated": 1.9, "decoded": None}
    assert kept_validation(history, 3) is None


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, eos_token_id=0, **TINY)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


class Oracle(torch.nn.Module):
    """A trainee whose drafter is the target itself: every draft is accepted (shift 0) or none
    is (shift 1)."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift

    def drafter(self, target):
        return OracleDrafter(target, self.shift), target


@pytest.mark.parametrize("shift, expected", [(0, 4.0), (1, 1.0)])
def test_the_decoder_pools_acceptance_over_prompts(target, shift, expected):
    prompts = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    decoder = ValDecoder(target, prompts, Chain(3), 6, ())
    trainee = Oracle(shift).train()
    assert decoder(trainee) == (expected, 0.0)  # every step accepts the same: no spread
    assert trainee.training  # handed back as it came


def test_the_standard_error_is_the_steps_spread_from_their_per_position_counts():
    accepted = [0, 3, 1, 0, 2, 3, 0, 1, 0, 0, 2, 1]  # each step's accepted drafts, k=3
    per_position = [sum(a > j for a in accepted) for j in range(3)]
    n, mean = len(accepted), sum(accepted) / len(accepted)
    spread = sum((a - mean) ** 2 for a in accepted) / n
    assert acceptance_se(per_position, n) == pytest.approx((spread / n) ** 0.5)
    assert acceptance_se([1], 1) == 0.0


class Samples(torch.utils.data.Dataset):
    """The loop's dataset interface over in-memory samples: a prompt of 6, an answer of 10."""

    def __init__(self, model, seed: int, count: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (count, 16), generator=g)
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        mask = torch.arange(16) >= 6
        self.items = [{"input_ids": i, "loss_mask": mask, "final_hidden": h} for i, h in zip(ids, hidden)]
        self.lengths = [16] * count

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


class Scripted:
    """Decoded validation with given results (standard error 0: the best is strictly the
    highest), keeping a copy of the head it was shown each time."""

    def __init__(self, values: list[float]):
        self.values, self.seen = values, []

    def __call__(self, trainee) -> tuple[float, float]:
        self.seen.append({k: v.clone() for k, v in trainee.head.state_dict().items()})
        return self.values[len(self.seen) - 1], 0.0


def medusa_fit(target, tmp_path: Path, select_by: str, val_decode,
               deadline: float | None = None) -> tuple[FitReport, list[dict]]:
    cfg = RootConfig(
        target=TargetConfig(name_or_path="tiny", device="cpu"),
        optim=OptimConfig(
            lr=1e-2,
            warmup_ratio=0.0,
            batch_tokens=64,
            max_batch_size=4,
            max_steps=8,
            val_every=2,
            save_every=2,
            val_decode_prompts=2,
            select_by=select_by,
        ),
        logging=LoggingConfig(tensorboard=False, progress=False),
        head=MedusaConfig(num_heads=2),
        run_dir=str(tmp_path),
    )
    torch.manual_seed(0)
    trainee = MedusaTrainee(MedusaHead.from_target(target, "tiny", cfg.head), 0.8)
    acc = build_accelerator(cfg.dist, cfg.optim, cfg.run_dir)
    result = fit(cfg, acc, trainee, Samples(target, 0, 32), Samples(target, 1, 4), tmp_path, None, val_decode,
                 deadline)
    history = json.loads((tmp_path / "history.json").read_text())
    return result, [h["val"] for h in history if "val" in h]


@pytest.mark.parametrize("select_by", ["decoded", "auto"])
def test_the_kept_head_is_the_best_decoded_one_not_the_last(target, tmp_path, select_by):
    scripted = Scripted([1.1, 1.7, 1.3, 1.2])
    result, validations = medusa_fit(target, tmp_path, select_by, scripted)
    assert [v[DECODED] for v in validations] == scripted.values
    assert result.best_step == 4 and result.best_score == 1.7 and result.select_by == "decoded"
    assert result.kept_validation == {"step": 4, "simulated": validations[1]["sim_acceptance_length"],
                                      "decoded": 1.7}
    assert result.between_steps.decoded_validations == 4
    kept = load_file(tmp_path / "head" / "model.safetensors")
    best, last = scripted.seen[1], scripted.seen[-1]
    assert kept.keys() == best.keys()
    assert all(torch.equal(kept[k], best[k]) for k in best)
    assert not all(torch.equal(kept[k], last[k]) for k in last)
    # A resumed run restores the best so far with the checkpoint.
    state = json.loads((tmp_path / "checkpoints" / "step-0000008" / STATE_FILE).read_text())
    assert state["best_score"] == 1.7 and state["best_step"] == 4


def test_simulated_selection_only_logs_the_decoded_value(target, tmp_path):
    result, validations = medusa_fit(target, tmp_path, "simulated", Scripted([9.0, 1.0, 1.0, 1.0]))
    scores = [v["score"] for v in validations]
    assert result.best_score == max(scores) and result.best_step == 2 * (1 + scores.index(max(scores)))
    assert [v[DECODED] for v in validations] == [9.0, 1.0, 1.0, 1.0]


def test_medusa_heads_decode_with_their_tree(target):
    """`build_val_decoder` with the evaluator's shape (Medusa: its static tree), the validation
    prompts' answers cut off, and a refusal up front for a tree the heads cannot draft."""
    head = MedusaHead.from_target(target, "tiny", MedusaConfig(num_heads=4))
    cfg = RootConfig(optim=OptimConfig(val_decode_prompts=3, val_decode_tokens=8),
                     head=MedusaConfig(num_heads=4))
    tokenizer = SimpleNamespace(eos_token_id=0)
    decoder = build_val_decoder(cfg, MedusaTrainee(head, 0.8), (target, tokenizer), Samples(target, 1, 4))
    assert decoder.max_new_tokens == 8  # optim.val_decode_tokens, not the evaluation's length
    assert [p.tolist() for p in decoder.prompts] == [
        Samples(target, 1, 4)[i]["input_ids"][:6].tolist() for i in (0, 2, 3)
    ]
    assert decoder(MedusaTrainee(head, 0.8))[0] >= 1.0
    small = MedusaHead.from_target(target, "tiny", MedusaConfig(num_heads=2))
    with pytest.raises(UserError, match="Medusa heads"):
        build_val_decoder(cfg, MedusaTrainee(small, 0.8), (target, tokenizer), Samples(target, 1, 4))
    # left to its default, decoded validation goes off in one line instead, the head kept by the
    # simulated figure; asked for (a number, or select_by=decoded), it is refused as above
    asked = RootConfig(head=MedusaConfig(num_heads=2))
    run, _ = resolve_decoding(asked)
    off, decoder, line = decoder_or_off(asked, run, MedusaTrainee(small, 0.8), (target, tokenizer),
                                        Samples(target, 1, 4))
    assert decoder is None and (off.optim.val_decode_prompts, off.optim.select_by) == (0, "simulated")
    assert line.startswith("decoded validation off (eval.tree needs ") and "keeps the head by it" in line
    for change in ({"optim.val_decode_prompts": 3}, {"optim.select_by": "decoded"}):
        chosen = derive(asked, change)
        with pytest.raises(UserError, match="Medusa heads"):
            decoder_or_off(chosen, resolve_decoding(chosen)[0], MedusaTrainee(small, 0.8),
                           (target, tokenizer), Samples(target, 1, 4))


def test_a_deadline_makes_the_step_that_passes_it_the_last(target, tmp_path):
    """The time budget's last guard (`trainer.plan.policy.PlanRecord.deadline`): a step ending past the
    deadline is validated, kept and checkpointed as the planned last step would be."""
    result, validations = medusa_fit(target, tmp_path, "auto", None, deadline=time.perf_counter())
    assert result.select_by == "simulated"  # auto, where nothing decodes
    assert result.steps == 1 and result.best_step == 1 and len(validations) == 1
    assert (tmp_path / "head" / "model.safetensors").exists()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000001"]
