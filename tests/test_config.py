"""Each YAML group under conf/ mirrors its config dataclass: a default changed on one side only
would make `python -m trainer.train` and code that builds the dataclass disagree silently."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import conf
from conf.compose import compose_root
from conf.errors import UserError
from conf.schema import Eagle3Config, MedusaConfig, RootConfig

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
        ("head/eagle3", Eagle3Config),
        ("head/medusa", MedusaConfig),
    ],
)
def test_yaml_group_mirrors_its_dataclass(group, schema):
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / f"{group}.yaml"))
    assert yaml == OmegaConf.to_container(OmegaConf.structured(schema))


@pytest.mark.parametrize(
    "overrides, epochs",
    [(["+head=eagle3"], Eagle3Config.DEFAULT_EPOCHS), (["+head=medusa"], MedusaConfig.DEFAULT_EPOCHS),
     (["+head=eagle3", "optim.epochs=2"], 2)],
)
def test_unset_epochs_take_the_heads_default(overrides, epochs):
    """`optim.epochs: null` resolves per head when the root config is built (so config.json and
    the model card name the number); an explicit value wins."""
    assert compose_root(overrides).optim.epochs == epochs


def test_nonsensical_epochs_are_refused():
    with pytest.raises(UserError, match=r"^optim.epochs=0: expected null or an integer >= 1$"):
        compose_root(["+head=eagle3", "optim.epochs=0"])


def test_unknown_matmul_dtype_is_refused():
    expected = r"^data.matmul_dtype='fp16': expected one of auto, target, bfloat16$"
    with pytest.raises(UserError, match=expected):
        compose_root(["+head=eagle3", "data.matmul_dtype=fp16"])
