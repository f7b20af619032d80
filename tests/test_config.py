"""Each YAML group under conf/ mirrors its config dataclass: a default changed on one side only
would make `python -m trainer.train` and code that builds the dataclass disagree silently."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import conf
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
