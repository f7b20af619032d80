"""The trainer's catalog (`trainer.kinds.CATALOG`) lists exactly the head kinds the records list
(`heads.kinds.KINDS`), and each entry builds its own kind: a trainee training a head of that kind,
and a drafter that drafts with that head. A kind added to one list and not the other fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from conf.errors import UserError
from data_prep.target import load_target
from heads.kinds import KINDS
from tests.support.runs import tiny_run_config
from tests.support.syncs import TINY, kind_builds
from tests.support.targets import kind_takes
from trainer.decoding.drafters import Chain, Tree
from trainer.kinds import CATALOG, build_drafter, build_trainee


def test_the_trainers_catalog_lists_every_head_kind_and_no_other():
    assert list(CATALOG) == list(KINDS)


def own_target(name: str, plain: Path, mtp: Path) -> Path:
    """The tiny target a kind builds on: the plain qwen2, or the target with MTP layers for a kind
    that refuses targets without them (`HeadKind.check_target`)."""
    return plain if kind_takes(KINDS[name], AutoConfig.from_pretrained(plain)) else mtp


@pytest.mark.parametrize("name", list(KINDS))
def test_each_catalog_entry_builds_its_own_kind(name, tiny_qwen2_dir, tiny_mtp_dir, chat_file, tmp_path):
    folder = own_target(name, tiny_qwen2_dir, tiny_mtp_dir)
    cfg = tiny_run_config(name, folder, chat_file, tmp_path / "run")
    target = load_target(str(folder))[0]
    trainee = build_trainee(cfg, target, None)
    assert trainee.head.kind == name
    drafter = build_drafter(KINDS[name], trainee.head, target, [Chain(3)])
    assert drafter.head is trainee.head
    if KINDS[name].chains_only:  # refused before the drafter is built, for every such kind
        with pytest.raises(UserError, match=f"^eval.mode=tree: a {name} head drafts one chain per forward"):
            build_drafter(KINDS[name], trainee.head, target, [Chain(3), Tree()])


def test_a_kind_without_tiny_trainees_fails_the_kind_wide_tests():
    """A test of the tests: a kind the records list and a kind-wide test's table lacks gets a
    parameter that fails naming it, rather than going untested."""
    params = kind_builds(TINY, [*KINDS, "next"])
    assert [p.id for p in params[:-1]] == [b.__name__ for name in KINDS for b in TINY[name]]
    with pytest.raises(pytest.fail.Exception, match="'next' has no tiny trainee"):
        params[-1].values[0](None)
