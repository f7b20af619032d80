"""Each YAML group under conf/ mirrors its config dataclass (a head kind's lists the knobs a user
tunes, at the class's defaults): a default changed on one side only would make
`python -m trainer.train` and code that builds the dataclass disagree silently."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import conf
from conf.compose import compose_root, compose_with_choices
from conf.errors import UserError
from conf.kinds import HEAD_CONFIGS, Eagle3Config, MedusaConfig
from conf.schema import DataConfig, OptimConfig, RootConfig, derive, duration_seconds
from conf.sizes import Sizes
from conf.usage import options, yaml_comments
from heads.kinds import KINDS

CONF = Path(conf.__file__).parent
ROOT_FIELDS = RootConfig.__dataclass_fields__


@pytest.mark.parametrize(
    "group, schema",
    [
        ("target/smollm2", ROOT_FIELDS["target"].default_factory),
        ("data/sharegpt", ROOT_FIELDS["data"].default_factory),
        ("optim/adamw", ROOT_FIELDS["optim"].default_factory),
        ("dist/none", ROOT_FIELDS["dist"].default_factory),
        ("logging/default", ROOT_FIELDS["logging"].default_factory),
        ("eval/default", ROOT_FIELDS["eval"].default_factory),
        ("export/default", ROOT_FIELDS["export"].default_factory),
    ],
)
def test_yaml_group_mirrors_its_dataclass(group, schema):
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / f"{group}.yaml"))
    if group.startswith("target/"):  # a global package: the target's fields and its budget
        assert duration_seconds(yaml.pop("budget")) is not None
        yaml = yaml.pop("target")
    assert yaml == OmegaConf.to_container(OmegaConf.structured(schema))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_head_kind_has_a_yaml_group_of_its_configs_defaults(kind):
    """Every kind in the catalog, none skipped. Its group lists only the knobs a user tunes: each
    key a field of the kind's config at the field's default, so YAML and class cannot drift; the
    rest come from Hydra's `kinds/<kind>` (`conf.schema.store_kinds`), so that every field, listed
    or not, is a key `+head=<kind> head.<key>=...` overrides."""
    cls = KINDS[kind].config
    assert HEAD_CONFIGS[kind] is cls
    path = CONF / "head" / f"{kind}.yaml"
    yaml = OmegaConf.to_container(OmegaConf.load(path))
    assert yaml.pop("defaults") == [f"/kinds/{kind}@_here_", "_self_"]
    assert yaml["name"] == kind
    defaults = OmegaConf.to_container(OmegaConf.structured(cls))
    assert {key: defaults.get(key, "not a field") for key in yaml} == yaml
    composed, _ = compose_with_choices([f"+head={kind}"])
    assert OmegaConf.to_container(composed.head) == defaults
    assert compose_root([f"+head={kind}"]).head == cls()


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "head").glob("*.yaml")))
def test_head_keys_are_documented_once_in_conf_kinds(group):
    """No key of a head group carries a comment: each field's is in `conf/kinds.py`, beside the
    field or above it, where `--help` reads it (`tests/unit/conf/test_cli_help.py`)."""
    assert yaml_comments(CONF / "head" / f"{group}.yaml") == {}


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "head").glob("*.yaml")))
def test_every_head_group_is_a_kind_or_a_recipe_of_one(group):
    """A head group that is not a kind's own (`eagle3.1`) is a published recipe: that kind's group
    plus the keys that make it, composing to a valid head of the kind."""
    head = compose_root([f"+head={group}"]).head
    assert head.name in KINDS
    if group not in KINDS:
        defaults = OmegaConf.load(CONF / "head" / f"{group}.yaml").defaults
        assert defaults == [head.name, "_self_"]


def test_eagle3_1_is_one_override():
    """EAGLE 3.1 (one RMSNorm per aux layer before fc, in place of the fused one) is
    `head.fc_norm=true` or `+head=eagle3.1`: `norm_before_fc` left unset follows fc_norm."""
    one = compose_root(["+head=eagle3", "head.fc_norm=true"]).head
    assert (one.fc_norm, one.norm_before_fc) == (True, False)
    assert compose_root(["+head=eagle3.1"]).head == one
    assert compose_root(["+head=eagle3"]).head.norm_before_fc is True
    assert compose_root(["+head=peagle", "head.fc_norm=true"]).head.norm_before_fc is False
    assert Eagle3Config(fc_norm=True).norm_before_fc is False and Eagle3Config().norm_before_fc is True
    # both, asked for by name, stay one or the other (speculators refuses both)
    with pytest.raises(UserError, match=r"^head.fc_norm=True: .*drop head.norm_before_fc=true"):
        compose_root(["+head=eagle3", "head.fc_norm=true", "head.norm_before_fc=true"])
    back = compose_root(["+head=eagle3.1", "head.fc_norm=false", "head.norm_before_fc=true"]).head
    assert back == compose_root(["+head=eagle3"]).head


def test_each_head_choice_runs_in_its_own_run_dir():
    """`run_dir` defaults to outputs/<the head's config choice>, not its kind's name: `+head=eagle3.1`
    (an eagle3 head) would otherwise stop on, or resume, an eagle3 run's folder. Alike in every
    command: composed here (`compose_root`, `--help`) and under `@hydra.main`, which reads the same
    `${hydra:runtime.choices.head}`."""
    dirs = {h: compose_root([f"+head={h}"]).run_dir for h in options("head")}
    assert dirs == {h: f"outputs/{h}" for h in options("head")}
    assert compose_root(["+head=eagle3.1"]).head.name == "eagle3"
    assert compose_root(["+head=eagle3.1", "run_dir=elsewhere"]).run_dir == "elsewhere"


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "target").glob("*.yaml")))
def test_every_target_group_sets_every_target_field_and_a_budget(group):
    cfg = compose_root(["+head=eagle3", f"target={group}"])
    assert cfg.budget_s is not None and cfg.target.name_or_path
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / "target" / f"{group}.yaml"))
    assert yaml.keys() == {"target", "budget"}
    assert yaml["target"].keys() == OmegaConf.structured(ROOT_FIELDS["target"].default_factory).keys()


@pytest.mark.parametrize(
    "overrides, budget_s, samples, epochs",
    [
        (["+head=eagle3"], 1200.0, DataConfig.DEFAULT_SAMPLES, Eagle3Config.DEFAULT_EPOCHS),
        (["+head=eagle3", "budget=1h30m"], 5400.0, DataConfig.DEFAULT_SAMPLES, 2),
        (["+head=eagle3", "budget=null"], None, DataConfig.DEFAULT_SAMPLES, 2),
        (["+head=eagle3", "budget=off"], None, DataConfig.DEFAULT_SAMPLES, 2),
        (["+head=eagle3", "data.max_samples=100"], None, 100, 2),
        (["+head=medusa", "optim.epochs=3"], None, DataConfig.DEFAULT_SAMPLES, 3),
    ],
)
def test_the_budget_plans_only_what_is_not_given(overrides, budget_s, samples, epochs):
    """Explicit data.max_samples or optim.epochs switch the planner off; sizes left unset take
    their defaults (`Sizes.of`), so a standalone `data_prep.prepare` needs no budget."""
    cfg = compose_root(overrides)
    sizes = Sizes.of(cfg)
    assert (cfg.budget_s, sizes.conversations, sizes.epochs) == (budget_s, samples, epochs)
    # the validation cadence too: 50 steps unless given, which the plan may then lengthen
    assert sizes.val_every == OptimConfig.DEFAULT_VAL_EVERY
    assert Sizes.of(compose_root([*overrides, "optim.val_every=20"])).val_every == 20


@pytest.mark.parametrize("value", ["20", "soon", "-5m", "0m"])
def test_nonsensical_budgets_are_refused(value):
    with pytest.raises(UserError, match=rf"^budget='{value}': expected a duration like 20m"):
        compose_root(["+head=eagle3", f"budget={value}"])


@pytest.mark.parametrize(
    "overrides, epochs",
    [(["+head=eagle3"], Eagle3Config.DEFAULT_EPOCHS), (["+head=medusa"], MedusaConfig.DEFAULT_EPOCHS),
     (["+head=eagle3", "optim.epochs=2"], 2)],
)
def test_unset_epochs_take_the_heads_default(overrides, epochs):
    """`optim.epochs: null` resolves per head (`Sizes.of`); the sizes a run goes on with are
    filled into a derived config (so config.json and the model card name the number); an
    explicit value wins."""
    cfg = compose_root(overrides)
    assert Sizes.of(cfg).epochs == epochs
    assert Sizes.of(cfg).apply(cfg).optim.epochs == epochs


def frozen_classes(obj) -> list[str]:
    """Every config dataclass reachable from `obj` that is not frozen (its dotted path)."""
    if not dataclasses.is_dataclass(obj):
        return []
    here = [] if obj.__dataclass_params__.frozen else [type(obj).__name__]
    return here + [name for f in dataclasses.fields(obj) for name in frozen_classes(getattr(obj, f.name))]


@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_the_checked_config_cannot_be_written(head):
    """Every group of the checked config is frozen: a stage that decides a value hands on a
    derived config (`derive`, `Sizes.apply`), checked again, and leaves the user's as it was."""
    cfg = compose_root([f"+head={head}"])
    assert frozen_classes(cfg) == []
    for group, name in (("data", "max_samples"), ("optim", "epochs"), ("target", "device"), ("head", "name")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, group), name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run_dir = "elsewhere"
    derived = derive(cfg, {"data.max_samples": 8, "optim.epochs": 3})
    assert (derived.data.max_samples, derived.optim.epochs) == (8, 3)
    assert (cfg.data.max_samples, cfg.optim.epochs) == (None, None)
    with pytest.raises(UserError, match=r"^optim.epochs=0: expected null or an integer >= 1$"):
        derive(cfg, {"optim.epochs": 0})  # derived values are checked like overrides


def test_nonsensical_epochs_are_refused():
    with pytest.raises(UserError, match=r"^optim.epochs=0: expected null or an integer >= 1$"):
        compose_root(["+head=eagle3", "optim.epochs=0"])


def test_unknown_matmul_dtype_is_refused():
    expected = r"^data.matmul_dtype='fp16': expected one of auto, target, bfloat16$"
    with pytest.raises(UserError, match=expected):
        compose_root(["+head=eagle3", "data.matmul_dtype=fp16"])
