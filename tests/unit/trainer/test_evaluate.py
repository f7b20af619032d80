"""The evaluator end to end on a tiny target: report files, metrics, task loading, and refusing
heads or settings that do not fit before anything is decoded."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conf.compose import compose_root
from conf.errors import UserError
from conf.kinds import MedusaConfig
from data_prep.target import resolve_target
from heads.folder import CONFIG_NAME
from heads.medusa.model import MedusaHead
from tests.support.decode import (
    chaotic_target,
)
from tests.support.heads import eagle_head
from tests.support.runs import QUICK
from tests.support.targets import TINY
from trainer.decoding import DecodeStats, greedy_generate
from trainer.evaluate.progress import EvalProgress
from trainer.evaluate.report import Record, fmt
from trainer.evaluate.run import evaluate, greedy_verdict, resolve_mode
from trainer.evaluate.tasks import load_prompts, user_prompts

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama.model, tiny_llama.tokenizer


@pytest.fixture(scope="module")
def eagle_dir(tiny, tiny_llama_dir, tmp_path_factory):
    return eagle_head(tiny[0], str(tiny_llama_dir), tmp_path_factory.mktemp("h") / "eagle3")


def config(kind: str, target_dir: Path, *overrides: str):
    return compose_root([f"+head={kind}", f"target.name_or_path={target_dir}", *QUICK, *overrides])


def test_evaluate_writes_the_report(tiny, tiny_llama_dir, eagle_dir, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        json.dumps({"task": "mine", "messages": [{"role": "user", "content": "Say hi."}]}) + "\n"
    )
    cfg = config("eagle3", tiny_llama_dir, f"eval.prompts={prompts}",
                 "eval.baselines=[greedy,prompt_lookup]")
    out = tmp_path / "eval"
    kept = {"step": 40, "simulated": 1.85, "decoded": 1.51}  # a main job's kept head (`kept_validation`)
    result = evaluate(cfg, eagle_dir, out, kept=kept)
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.png", "eval.json", "eval.md"]
    assert json.loads((out / "eval.json").read_text()) == result
    assert result["lossless"] is True and set(result["tasks"]) == {"mtbench", "gsm8k", "mine"}
    o = result["overall"]
    assert o["prompts"] == 3 and o["new_tokens"] == 30
    assert o["mean_acceptance_length"] == 1 + o["accepted_tokens"] / o["drafts"]
    assert len(o["acceptance_per_position"]) == 3
    assert o["speedup_vs_greedy"] == pytest.approx(
        o["spec_tokens_per_s"] / o["greedy_tokens_per_s"], rel=1e-3)
    assert {"prompt_lookup_tokens_per_s", "speedup_vs_prompt_lookup"} <= o.keys()
    md = (out / "eval.md").read_text()
    assert "| overall | 3 |" in md and "| mine | 1 |" in md
    # the train-versus-serve gap: the kept head's simulated τ against the evaluated one
    evaluated = o["mean_acceptance_length"]
    gap = result["validation_gap"]
    assert gap == {**kept, "evaluated": evaluated, "gap": round(1.85 - evaluated, 4),
                   "gap_against": "evaluated"}
    assert (f"the kept head (step 40): simulated τ 1.850 (teacher-forced), decoded 1.510 on validation "
            f"prompts, evaluated {evaluated:.3f}; the simulated τ overstates the evaluated one by "
            f"{1.85 - evaluated:+.3f}") in md
    assert md.rstrip().endswith("![Per-position acceptance](acceptance.png)")  # eval.md shows it
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    # Where a step's time goes, and the chain settings swept from it (trainer/evaluate/settings.py).
    assert o["draft_ms_per_step"] > 0 and o["verify_ms_per_step"] > 0 and o["other_ms_per_step"] > 0
    assert "## Where a step's time goes" in md and "## Draft length and p_min" in md
    sweep = result["draft_settings"]
    assert sorted(sweep["step_costs"]) == ["1", "2", "3"]
    assert {(r["k"], r["p_min"]) for r in sweep["rows"]} == {(k, p) for k in (1, 2, 3)
                                                            for p in (0.0, 0.3, 0.5, 0.75, 0.9)}
    pick = sweep["best"] or sweep["fastest"]
    assert pick["speedup_vs_greedy"] == max(r["speedup_vs_greedy"] for r in sweep["rows"])
    check = sweep["check"]
    assert (check["k"], check["p_min"]) == (pick["k"], pick["p_min"]) and check["same_as_greedy"] is True
    # Recommended only where predicted and decoded both beat greedy decoding.
    pays = pick["speedup_vs_greedy"] >= 1.0 and check["measured"]["speedup_vs_greedy"] >= 1.0
    assert (sweep["best"] is not None) == pays


def test_a_p_min_run_sweeps_from_its_own_p_min(tiny, tiny_llama_dir, eagle_dir, tmp_path):
    """eval.draft_p_min=0.3: decoded losslessly with chains cut there, its step costs measured at
    p_min 0 by a run of its own (k = K too), and only p_min >= 0.3 predicted."""
    cfg = config("eagle3", tiny_llama_dir, "eval.draft_p_min=0.3", "eval.tasks=[gsm8k]")
    result = evaluate(cfg, eagle_dir, tmp_path)
    assert result["lossless"] is True and result["settings"]["draft_p_min"] == 0.3
    sweep = result["draft_settings"]
    assert sorted(sweep["step_costs"]) == ["1", "2", "3"]
    assert sorted({r["p_min"] for r in sweep["rows"]}) == [0.3, 0.5, 0.75, 0.9]
    assert "chain drafting (k=3, p_min 0.3)" in (tmp_path / "eval.md").read_text()


def test_evaluate_shows_progress_in_logs(tiny, tiny_llama_dir, eagle_dir, tmp_path, capsys):
    # capsys' stderr is no terminal, as in CI or a log file: plain lines, no bar.
    cfg = config("eagle3", tiny_llama_dir)
    target = resolve_target(cfg)
    assert target.model is target.model  # loaded once, before the evaluation's own lines
    capsys.readouterr()
    result = evaluate(cfg, eagle_dir, tmp_path, target=target)
    o = result["overall"]
    assert capsys.readouterr().err.splitlines() == [
        f"eval: 2/2 prompts, {fmt(o['spec_tokens_per_s'])} tokens/s, "
        f"mean acceptance length {fmt(o['mean_acceptance_length'])}"
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def show_prompts(progress: EvalProgress, n: int) -> None:
    """n prompts of 10 tokens in 1 s, 4 drafts each; prompt i accepts i drafted tokens."""
    records = []
    for i in range(n):
        spec = DecodeStats(new_tokens=10, total_s=1.0, drafts=4, accepted_tokens=i)
        records.append(Record("t", spec, DecodeStats(), None, "same"))
        progress.show(records)
    progress.close()


@pytest.mark.parametrize("stream, bars", [(io.StringIO(), True), (Terminal(), False)],
                         ids=["not-a-terminal", "progress-off"])
def test_progress_without_bars_prints_a_line_every_few_prompts(stream, bars):
    show_prompts(EvalProgress(7, bars, stream, every=3), 7)
    assert stream.getvalue().splitlines() == [
        "eval: 3/7 prompts, 10.000 tokens/s, mean acceptance length 1.250",  # 1 + 3 / 12
        "eval: 6/7 prompts, 10.000 tokens/s, mean acceptance length 1.625",  # 1 + 15 / 24
        "eval: 7/7 prompts, 10.000 tokens/s, mean acceptance length 1.750",  # 1 + 21 / 28
    ]


def test_progress_on_a_terminal_is_a_bar_over_prompts():
    stream = Terminal()
    show_prompts(EvalProgress(7, True, stream, every=3), 7)
    shown = stream.getvalue()
    assert "7/7" in shown and "tok/s=10.000, mean acc len=1.750" in shown
    assert "eval: 3/7 prompts" not in shown


def test_medusa_head_in_tree_mode(tiny, tiny_llama_dir, tmp_path):
    head = MedusaHead.from_target(tiny[0], str(tiny_llama_dir), MedusaConfig(num_heads=3))
    folder = head.save_pretrained(tmp_path / "medusa")
    choices = "eval.tree.medusa_choices=[[0],[1],[0,0],[0,0,0]]"
    cfg = config("medusa", tiny_llama_dir, "eval.mode=tree", choices)
    result = evaluate(cfg, folder, tmp_path / "eval")
    assert result["lossless"] and len(result["overall"]["acceptance_per_position"]) == 3
    assert "static tree drafting (4 nodes)" in (tmp_path / "eval" / "eval.md").read_text()
    too_deep = config("medusa", tiny_llama_dir, "eval.mode=tree",
                      "eval.tree.medusa_choices=[[0],[0,0],[0,0,0],[0,0,0,0]]")
    with pytest.raises(UserError, match="needs 4 Medusa heads; the head has 3"):
        evaluate(too_deep, folder, tmp_path / "eval2")


def test_head_for_another_target_is_refused_before_decoding(tiny, tiny_llama_dir, tmp_path):
    other = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "num_hidden_layers": 6},
                                                         vocab_size=tiny[0].config.vocab_size))
    foreign = eagle_head(other, "other-target", tmp_path / "foreign", aux=[1, 2, 3])
    with pytest.raises(UserError, match="num_hidden_layers 6 != 8"):
        evaluate(config("eagle3", tiny_llama_dir), foreign, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_aux_layer_ids_outside_the_target_are_refused(tiny, tiny_llama_dir, eagle_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in eagle_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    meta = json.loads((bad / CONFIG_NAME).read_text())
    meta["config"]["aux_layer_ids"] = [2, 4, 12]
    (bad / CONFIG_NAME).write_text(json.dumps(meta))
    # Named as the main job and `trainer.evaluate` alike take it: no `head=`, the fix an override.
    expected = (
        r"^the head at '.*': aux_layer_ids=\[2, 4, 12\]: expected 3 distinct ids in 0\.\.8 "
        r".*; train with head\.aux_layer_ids=\[a, b, c\]$"
    )
    with pytest.raises(UserError, match=expected):
        evaluate(config("eagle3", tiny_llama_dir), bad, tmp_path / "eval")


def test_greedy_verdict_tells_rounding_ties_from_mismatches():
    model = chaotic_target("llama")
    prompt = torch.tensor([1, 2, 3])
    plain = greedy_generate(model, prompt, 6).tokens
    assert greedy_verdict(model, prompt, plain, plain) == "same"
    wrong = plain[:2] + [(plain[2] + 1) % 256] + plain[3:]
    assert greedy_verdict(model, prompt, plain, wrong) == "mismatch"
    assert greedy_verdict(model, prompt, plain, plain[:4]) == "mismatch"
    # Tokens 3 and 7 get identical logits, far above the rest: an exact tie at every step.
    model.lm_head.weight.data[7] = model.lm_head.weight.data[3]
    bias = torch.zeros(256)
    bias[[3, 7]] = 1e3
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    tied = greedy_generate(model, prompt, 6).tokens
    assert set(tied) <= {3, 7}
    assert greedy_verdict(model, prompt, tied, [10 - tied[0]] + tied[1:]) == "tie"


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.mode=beam", "eval.mode='beam'"),
        ("eval.num_speculative_tokens=0", "eval.num_speculative_tokens=0"),
        ("eval.top_p=0", "eval.top_p=0"),
        ("eval.draft_p_min=1.0", "eval.draft_p_min=1.0: expected a probability in \\[0, 1\\)"),
        ("eval.baselines=[greedy,medusa]", "eval.baselines=\\['greedy', 'medusa'\\]: expected a subset"),
        ("eval.tasks=[mmlu]", "eval.tasks=\\['mmlu'\\]: unknown task"),
    ],
)
def test_bad_eval_settings_are_refused(tiny, tiny_llama_dir, eagle_dir, tmp_path, override,
                                       message):
    with pytest.raises(UserError, match=message):
        evaluate(config("eagle3", tiny_llama_dir, override), eagle_dir, tmp_path)


def test_builtin_tasks_come_from_the_installed_packages():
    cfg = compose_root(["+head=eagle3", "eval.max_prompts_per_task=8"]).eval
    tasks = load_prompts(cfg)
    assert {t: len(p) for t, p in tasks.items()} == {"mtbench": 8, "humaneval": 8, "gsm8k": 8}
    assert tasks["gsm8k"][0].messages[0]["content"].startswith("Janet")
    assert "def " in tasks["humaneval"][0].messages[0]["content"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 1: not valid JSON"),
        ('{"prompt": "hi"}', 'line 1: expected an object with a string "task"'),
        ('{"task": "t", "messages": [{"role": "user"}]}', 'expected "prompt"'),
    ],
)
def test_bad_user_prompts_name_the_line(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(UserError, match=message):
        user_prompts(str(f))


def test_auto_mode_drafts_each_head_as_it_is_served():
    assert resolve_mode("auto", "eagle3") == "chain" and resolve_mode("auto", "medusa") == "tree"
    assert resolve_mode("chain", "medusa") == "chain" and resolve_mode("tree", "eagle3") == "tree"
