"""`trainer.train`'s command line, in process: every bad value of the new-user list is one line
naming the override, exit 2, before the target is converted or loaded and before any data stage.
(tests/e2e/test_train.py runs a few of them as real processes.)"""

from __future__ import annotations

import pytest

from conf.compose import check_command_line
from conf.errors import exit_on_user_error
from trainer.train import run

# Each bad value of the new-user list, and the rule behind it: one line naming the override,
# exit 2, before the target is converted or loaded and before any data stage (the cache and the
# run folder stay untouched), and no Hydra hint after it.
BAD_OVERRIDES = [
    ("eval.mode=tre", "eval.mode='tre'"),
    ("eval.baselines=[x]", "eval.baselines=['x']"),
    ("logging.wandb=onlin", "logging.wandb='onlin'"),
    ("export.dtype=bf16", "export.dtype='bf16'"),
    ("export.gguf_type=q4_0", "export.gguf_type='q4_0'"),
    ("export.formats=[nope]", "export.formats=['nope']"),
    ("export.formats=[medusa-tgi]", "export.formats=['medusa-tgi']"),
    ("+head=medusa head.num_heads=0", "head.num_heads=0"),
    ("+head=peagle head.parallel_tokens=1", "head.parallel_tokens=1"),
    ("+head=peagle +head.ttt_length=4", "head.ttt_length=4: expected null"),
    ("+head=peagle export.formats=[eagle3]", "export.formats=['eagle3']"),
    ("optim.lr=-1", "optim.lr=-1"),
    ("optim.lr=abc", "optim.lr"),
    ("optim.grad_accum=0", "optim.grad_accum=0"),
    ("optim.batch_tokens=0", "optim.batch_tokens=0"),
    ("optim.packing=maybe", "optim.packing"),
    ("optim.no_such_key=1", "optim.no_such_key"),
    ("data.max_samples=-1", "data.max_samples=-1"),
    ("data.storage_dtype=int4", "data.storage_dtype='int4'"),
    ("data.hidden_states=onlin", "data.hidden_states='onlin'"),
    ("data.regenerate.max_new_tokens=600", "data.regenerate.max_new_tokens=600"),
    ("dist=zero9", "dist=zero9"),
    ("+head=eagel3", "head=eagel3"),
    ("target.dtype=fp32", "target.dtype='fp32'"),
    ("data.source=/nonexistent/chats.jsonl", "/nonexistent/chats.jsonl"),
    ("data.chat_template=/nonexistent/t.jinja", "data.chat_template='/nonexistent/t.jinja'"),
    ("data.template_date=2026-13-01", "data.template_date='2026-13-01'"),
    ("data.chat_template_kwargs=3", "data.chat_template_kwargs"),
    ("resume=true", "resume=true"),
    ("head.prompt_loss_weight=2", "head.prompt_loss_weight=2"),
    ("head.loss=kl", "head.loss='kl'"),
    ("+head=medusa head.tv_weight=0", "head.tv_weight=0"),
    ("head.lk_eta=-1", "head.lk_eta=-1"),
    ("optim.select_by=best", "optim.select_by='best'"),
    ("optim.select_by=decoded optim.val_decode_prompts=0", "optim.select_by='decoded'"),
    ("optim.select_by=decoded dist=zero3", "optim.select_by='decoded'"),
    ("optim.val_decode_tokens=0", "optim.val_decode_tokens=0"),
    ("optim.val_decode_prompts=-1", "optim.val_decode_prompts=-1"),
    ("optim.val_decode_prompts=4 data.val_fraction=0", "optim.val_decode_prompts=4"),
    ("optim.val_decode_prompts=4 dist=zero3", "optim.val_decode_prompts=4"),
    ("optim.on_policy=2", "optim.on_policy=2"),
    ("+head=medusa optim.on_policy=0.5 budget=null", "optim.on_policy=0.5: a medusa head does not train"),
    ("optim.on_policy=0.5", "optim.on_policy=0.5: the time budget's planner does not price"),
    ("optim.on_policy=0.5 budget=null optim.packing=true", "set optim.packing=false"),
]


def train_command(argv: list[str]) -> None:
    """What `python -m trainer.train <argv>` does before Hydra runs the app (the command line is
    composed as Hydra will compose it), then the app itself."""
    cfg = check_command_line(argv)
    exit_on_user_error(run)(cfg)


# What only the target's config can refuse: checked on a folder target (the embedded one is
# converted first, which is what resolving it means), still before any data stage.
TARGET_BAD_OVERRIDES = [
    ("+head=peagle head.mask_token_id=1000000", "head.mask_token_id=1000000"),
    ("+head=dflash head.mask_token_id=1000000", "head.mask_token_id=1000000"),
]


@pytest.mark.parametrize("overrides, expected", BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_bad_overrides_fail_before_loading(overrides, expected, tmp_path, capsys, monkeypatch):
    assert_refused(overrides, expected, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize(
    "overrides, expected", TARGET_BAD_OVERRIDES, ids=[o for o, _ in TARGET_BAD_OVERRIDES]
)
def test_settings_the_target_cannot_take_fail_before_data(
    overrides, expected, tmp_path, capsys, monkeypatch, tiny_llama_dir
):
    on_folder = f"{overrides} target.name_or_path={tiny_llama_dir}"
    assert_refused(on_folder, expected, tmp_path, capsys, monkeypatch)


def assert_refused(overrides: str, expected: str, tmp_path, capsys, monkeypatch) -> None:
    head = [] if "+head=" in overrides else ["+head=eagle3"]
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    with pytest.raises(SystemExit) as done:
        train_command([*head, *overrides.split(), f"run_dir={run_dir}", "logging.progress=false"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert done.value.code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert out == ""
    assert not cache.exists(), "the target or the data was touched before the error"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "summary.json").exists()
