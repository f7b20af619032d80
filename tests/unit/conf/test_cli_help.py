"""Every entry point's `--help` lists its keys, their defaults and a one-line meaning read from the
comments in conf/ (`conf.usage`), and an unknown key is one line naming the closest keys: here in
process, on the composed configs. The entry points' `--help` and an unknown key run as users type
them (one interpreter each) are tests/e2e/test_cli_help.py's."""

from __future__ import annotations

import dataclasses

import pytest

from conf.compose import compose_root, compose_with_choices
from conf.errors import UserError
from conf.kinds import HEAD_CONFIGS
from conf.schema import DistConfig, TargetConfig, leaf_fields, schema_keys
from conf.usage import config_keys, help_lines, meanings, options, schema_comment, yaml_comments
from tests.support.cli import CONFIG_LINE


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["+head=eagle3", "head.fc_nrom=true"], "head.fc_nrom: no such key; closest: head.fc_norm"),
        # appended with `+`: Hydra takes it, the schema refuses it
        (["+head=eagle3", "+optim.lrr=1"], "optim.lrr: no such key; closest: optim.lr"),
        (["+head=eagle3", "+head.fc_nrom=true"], "head.fc_nrom: no such key; closest: head.fc_norm"),
        (["+head=eagle3", "lr=1e-3"], "lr: no such key; closest: optim.lr"),  # the group left out
        (["+head=eagle3.1", "head.norm_befor_fc=true"],
         "head.norm_befor_fc: no such key; closest: head.norm_before_fc"),
        (["+head=medusa", "head.num_head=2"], "head.num_head: no such key; closest: head.num_heads"),
        (["head.fc_norm=true"], "head.fc_norm: no head chosen; add +head=<name> before it, one of "
                                + ", ".join(HEAD_CONFIGS)),
        (["head=eagle3"], "head=eagle3: no head is in the defaults; add one with +head=eagle3"),
    ],
)
def test_unknown_keys_name_the_closest_valid_ones(overrides, line):
    with pytest.raises(UserError) as err:
        compose_root(overrides)
    assert str(err.value) == line


def test_no_close_key_points_to_help():
    with pytest.raises(UserError, match=r"^zzz: no such key; --help lists the keys$"):
        compose_root(["+head=eagle3", "zzz=1"])


def test_every_key_of_every_group_option_has_a_meaning():
    """A key added to the schema with no comment beside it in conf/ (nor in the schema) fails here,
    for every head group and every option of every other group."""
    setups = [[f"+head={h}"] for h in options("head")]
    setups += [["+head=eagle3", f"{g}={o}"] for g in ("target", "dist") for o in options(g)]
    for overrides in setups:
        cfg, choices = compose_with_choices(overrides)
        keys = [k for k in config_keys(cfg) if k != "head.name"]
        missing = [k for k, text in meanings(cfg, choices, keys).items() if not text]
        assert missing == [], overrides
        assert len(help_lines(cfg, choices)) > len(keys)


def test_help_shows_the_composed_defaults():
    cfg, choices = compose_with_choices(["+head=eagle3.1", "target=qwen2.5-coder-0.5b", "optim.lr=1e-4"])
    lines = {m[1]: m[2] for m in map(CONFIG_LINE.match, help_lines(cfg, choices)) if m}
    assert (lines["head.fc_norm"], lines["head.norm_before_fc"]) == ("true", "false")
    assert (lines["budget"], lines["optim.lr"]) == ("30m", "0.0001")
    assert lines["eval.tasks"] == "[mtbench, humaneval, gsm8k]"


def test_yaml_comments_follow_nesting_and_global_packages(tmp_path):
    group = tmp_path / "g.yaml"
    group.write_text(
        "# a block comment above is not a meaning\n"
        "a: 1          # the a\nb:\n  c: [x, y]   # the c\n  d: 2\ne: null  # the e\n"
    )
    assert yaml_comments(group, "g.") == {"g.a": "the a", "g.b.c": "the c", "g.e": "the e"}
    group.write_text("# @package _global_\nt:\n  k: 1  # the k\n")
    assert yaml_comments(group, "g.") == {"t.k": "the k"}


def test_schema_comments_beside_a_field_else_the_first_sentence_above():
    assert schema_comment(DistConfig, "zero_stage").startswith("DeepSpeed's ZeRO stage")
    assert schema_comment(TargetConfig, "device") == '"auto": cuda if available, else cpu.'
    # inherited fields are found in the class that declares them
    peagle, medusa = HEAD_CONFIGS["peagle"], HEAD_CONFIGS["medusa"]
    assert schema_comment(peagle, "loss") == schema_comment(medusa, "loss")
    assert schema_comment(medusa, "loss").startswith("The per-row loss: ce")
    # the first sentence of a long block, cut to one line
    assert schema_comment(peagle, "prompt_loss_weight").startswith("Rows that train, as the shared")
    assert len(schema_comment(medusa, "prompt_loss_weight")) <= 110
    # a head's keys mean what `conf/kinds.py` says: their YAML carries no comment
    assert schema_comment(HEAD_CONFIGS["dspark"], "num_layers").startswith("Qwen3-style draft layers")


def test_leaf_fields_are_the_schema_keys():
    keys = set(leaf_fields(HEAD_CONFIGS["dflash"], "head."))
    assert {"head.block_size", "head.loss"} <= keys
    assert {f"head.{f.name}" for f in dataclasses.fields(HEAD_CONFIGS["dflash"])} == keys
    assert "data.regenerate.top_p" in schema_keys() and "data.regenerate" not in schema_keys()
