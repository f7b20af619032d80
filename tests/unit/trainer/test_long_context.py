"""The long-context task (`eval.context_lengths`): prompts built from the packaged data land in
their buckets as the target's template renders them, the evaluator reports them by bucket
(losslessly, as every task, also with an inference-only draft window), a bucket the target
cannot hold and nonsensical bounds are one line, and the planner prices the long prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conf.compose import compose_root
from conf.errors import UserError
from data_prep.target import resolve_target
from tests.support.heads import eagle_head
from tests.support.runs import user_error_line
from trainer.evaluate.long_context import TASK, bucket_of, buckets, label, long_context_prompts
from trainer.evaluate.run import evaluate, slide
from trainer.plan import probes
from trainer.plan.probes import evaluation_probe

pytestmark = pytest.mark.usefixtures("single_thread")
SHORT = ["eval.tasks=[]", "eval.max_new_tokens=8", "eval.max_prompts_per_task=2"]


def config(target_dir: Path, *overrides: str):
    return compose_root(["+head=eagle3", f"target.name_or_path={target_dir}", *SHORT, *overrides])


@pytest.fixture(scope="module")
def eagle_dir(tiny_model, tiny_llama_dir, tmp_path_factory):
    model = tiny_model
    return eagle_head(model, str(tiny_llama_dir), tmp_path_factory.mktemp("h") / "eagle3")


def test_buckets_are_named_and_found_by_their_bounds():
    assert buckets([1024, 4096, 8192]) == [(0, 1024), (1024, 4096), (4096, 8192)]
    assert [label(lo, hi) for lo, hi in buckets([512, 1536, 4096])] == ["<=512", "512-1.5k", "1.5k-4k"]
    assert [bucket_of(n, [1024, 4096]) for n in (1, 1024, 1025, 4096, 4097)] == [0, 0, 1, 1, None]


def test_prompts_land_in_their_buckets_as_the_template_renders_them(smol_tokenizer):
    """SmolLM2's own tokenizer and template; chat histories and code modules alternate, no two
    prompts alike, and a second build gives the same ids."""
    cfg = compose_root(["+head=eagle3", "eval.context_lengths=[1024,2048,4096]",
                        "eval.max_prompts_per_task=3"])
    made = long_context_prompts(cfg, smol_tokenizer, 8192)
    assert [task for task, _ in made] == [TASK] * 9
    lengths = [len(ids) for _, ids in made]
    assert [bucket_of(n, [1024, 2048, 4096]) for n in lengths] == [0, 0, 0, 1, 1, 1, 2, 2, 2], lengths
    texts = [smol_tokenizer.decode(ids) for _, ids in made]
    assert len(set(texts)) == 9
    # A chat history is several user turns, a code module one with the functions in it.
    users = [t.count("<|im_start|>user") for t in texts]
    assert [n == 1 for n in users] == [False, True, False] * 3, users
    assert all("```python\ndef " in t or "```python\nfrom " in t or "```python\nimport " in t
               for t in texts[1::3]), [t[:300] for t in texts[1::3]]
    assert all(t.rstrip().endswith("assistant") for t in texts)  # the generation prompt last
    again = long_context_prompts(cfg, smol_tokenizer, 8192)
    assert all(a.tolist() == b.tolist() for (_, a), (_, b) in zip(made, again))


def test_the_last_bucket_is_cut_to_the_target_s_context_and_one_beyond_it_refused(smol_tokenizer):
    cfg = compose_root(["+head=eagle3", "eval.context_lengths=[1024,4096]", "eval.max_prompts_per_task=1",
                        "eval.max_new_tokens=96"])
    (_, short), (_, long) = long_context_prompts(cfg, smol_tokenizer, 2048)
    assert 1024 < len(long) <= 2048 - 96
    line = user_error_line(lambda: long_context_prompts(cfg, smol_tokenizer, 1024))
    assert line == ("error: eval.context_lengths=[1024, 4096]: the bucket 1k-4k starts beyond what "
                    "the target holds (max_position_embeddings 1024, less eval.max_new_tokens=96); "
                    "drop it or use a target with a longer context"), line


@pytest.mark.parametrize("bounds, says", [
    *((b, r"eval.context_lengths=.*: expected whole numbers of tokens >= 256, ascending")
      for b in ("[4096,1024]", "[100]", "[1024,1024]")),
    ("[1.5]", r"eval.context_lengths\[0\]: Value '1.5' of type 'float' could not be converted to Integer"),
])
def test_nonsensical_bounds_are_one_line(bounds, says):
    with pytest.raises(UserError, match=says):
        compose_root(["+head=eagle3", f"eval.context_lengths={bounds}"])


def test_the_evaluator_reports_acceptance_by_context_length(tiny_llama_dir, eagle_dir, tmp_path):
    cfg = config(tiny_llama_dir, "eval.context_lengths=[256,768]")
    out = tmp_path / "eval"
    result = evaluate(cfg, eagle_dir, out)
    assert result["lossless"] is True and set(result["tasks"]) == {TASK}
    rows = result["by_context"]
    assert list(rows) == ["<=256", "256-768"]
    assert [m["prompts"] for m in rows.values()] == [2, 2]
    assert rows["<=256"]["max_context_tokens"] <= 256 < rows["256-768"]["mean_context_tokens"] <= 768
    assert all(m["lossless"] and m["mean_acceptance_length"] >= 1 for m in rows.values())
    assert json.loads((out / "eval.json").read_text())["by_context"] == rows
    md = (out / "eval.md").read_text()
    assert "## By context length" in md and "| <=256 | 2 |" in md and "| 256-768 | 2 |" in md
    assert md.rstrip().endswith("![Acceptance by context length](context.png)")
    assert (out / "context.png").read_bytes()[:4] == b"\x89PNG"
    plain = evaluate(config(tiny_llama_dir, "eval.tasks=[gsm8k]"), eagle_dir, tmp_path / "plain")
    assert "by_context" not in plain and not (tmp_path / "plain" / "context.png").exists()


def test_the_planner_prices_the_long_prompts(tiny_llama_dir, eagle_dir, monkeypatch):
    """The same prompt count costs more seconds when it is longer: the probe decodes the long
    prompts and prices each by its length. The decoders run for real; their clock is replaced by
    a cost that grows with the prompt (prefill and every step read the whole context), so the
    pricing is checked without a 2-core machine's timing noise."""
    probed: list[int] = []

    def rates_by_length(decode, ids, warm):
        real_decode_rates(decode, ids, warm)
        probed.append(len(ids))
        return 1e-4 * len(ids), 1e-3 + 1e-6 * len(ids)

    real_decode_rates = probes._decode_rates
    monkeypatch.setattr(probes, "_decode_rates", rates_by_length)
    target = resolve_target(config(tiny_llama_dir))
    short = evaluation_probe(config(tiny_llama_dir, "eval.context_lengths=[256]"), target, eagle_dir)
    short_probed, probed[:] = max(probed), []
    long = evaluation_probe(config(tiny_llama_dir, "eval.context_lengths=[1536]"), target, eagle_dir)
    assert short_probed <= 256 < max(probed), (short_probed, probed)
    assert long > 1.5 * short, (short, long)


def test_an_inference_only_draft_window_stays_lossless_and_is_reported(tiny_llama_dir, eagle_dir, tmp_path):
    result = evaluate(config(tiny_llama_dir, "eval.context_lengths=[512]", "eval.sliding_window=16"),
                      eagle_dir, tmp_path)
    assert result["lossless"] is True and result["settings"]["sliding_window"] == 16
    assert "the draft attending to the last 16 positions" in (tmp_path / "eval.md").read_text()
    line = user_error_line(lambda: slide(object(), 16, "medusa"))
    assert line == ("error: eval.sliding_window=16: a medusa head has no attention to slide; "
                    "set eval.sliding_window=null")
    with pytest.raises(UserError, match="eval.sliding_window=8: expected null or a number of positions"):
        config(tiny_llama_dir, "eval.sliding_window=8")
