"""The time budget (`trainer/plan/`): the plan's arithmetic and its record, pure, and the probes on a
tiny target."""

from __future__ import annotations

import dataclasses
import json

import pytest

import trainer.plan
from conf.compose import compose_root
from conf.errors import UserError
from conf.schema import OptimConfig, derive
from data_prep.answers.regen_cost import StepCost
from data_prep.answers.regenerate import read_cache
from data_prep.conversations.rows import cached_spans, uncached_prefix
from data_prep.folders.keys import regen_cache_file
from data_prep.prepare import prepare
from data_prep.target import resolve_target
from heads.kinds import head_kind
from tests.support.runs import conversations, tiny_prep_config
from trainer.plan import reuse
from trainer.plan.policy import (
    MARGIN,
    MAX_EPOCHS,
    MIN_CONVERSATIONS,
    PlanRecord,
    Rates,
    RegenShape,
    Schedule,
    decide_recheck,
    fit_steps,
    fitting_plan,
    make_plan,
    schedule,
    train_cost,
    val_decode_cost,
)
from trainer.plan.probes import PROBE_SAMPLES, regeneration_probe, train_probe
from trainer.val_decode import MIN_VAL_DECODE_PROMPTS, VAL_DECODE_SHARE

EAGLE3 = head_kind("eagle3")


def rates(**kw) -> Rates:
    """Rates with nothing between the steps (no validation or saving cost) unless given."""
    base = dict(regenerate_tokens_per_s=100.0, capture_tokens_per_s=1000.0, train_tokens_per_s=500.0,
                tokens_per_step=1000.0, validate_s_per_token=0.0, save_best_s=0.0, checkpoint_s=0.0,
                answer_tokens=200.0, row_tokens=300.0, evaluate_s=60.0, export_s=10.0,
                cached_spans=(), probe_s=30.0)
    return Rates(**{**base, **kw})


def plan(budget_s=1200, spent_s=60, epochs=2, train_share=1.0, **kw):
    return make_plan(budget_s, spent_s, rates(**kw), Schedule(epochs, 1, train_share, 50, 50))


def test_the_plan_fills_the_budget_less_the_margin():
    plan = make_plan(1200, 60, rates(), Schedule(epochs=2, answers=1, train_share=1.0, val_every=50,
                                                 save_every=50))
    # per conversation: 2 s regenerate + 0.3 s capture + 2 x 0.6 s training = 3.5 s
    assert plan.conversations == int((1200 * (1 - MARGIN) - 60 - 60 - 10) / 3.5)
    assert plan.total_s == pytest.approx(1200 * (1 - MARGIN), abs=3.5)
    assert plan.regenerate_s == pytest.approx(2 * plan.conversations)
    assert "conversations x 1 answer, 2 epochs" in plan.line() and plan.line().endswith("of 20 min")


def test_cached_answers_are_free():
    cold = plan()
    warm = plan(cached_spans=((0, 200),))
    # the 200 cached conversations save 2 s each, spent on more conversations at 3.5 s
    assert warm.conversations == pytest.approx(cold.conversations + 200 * 2 / 3.5, abs=1)
    assert warm.regenerate_s == pytest.approx(2 * (warm.conversations - 200))
    # cached where they are: 200 cached beyond the conversations the plan can buy save nothing,
    # and 100 cached among them save what 100 do
    assert plan(cached_spans=((10**5, 10**5 + 200),)) == cold
    scattered = plan(cached_spans=((50, 100), (150, 200)))
    assert scattered.regenerate_s == pytest.approx(2 * (scattered.conversations - 100))
    everything = plan(cached_spans=((0, 10**6),))
    assert everything.regenerate_s == 0 and everything.conversations == int((1200 * (1 - MARGIN) - 130) / 1.5)


def test_the_engines_regeneration_is_priced_by_its_schedule_not_the_probes_rate():
    """The probe answered one batch of 4 (one answer of 201 tokens, three of 11) on 4 slots in
    200 steps and one prefill, mostly on one busy row; a long run keeps its slots full, so it
    writes about 4 tokens a step, where the probe's rate says 1.15. A batch and a half of equal
    answers takes as long as two."""
    cost = StepCost(per_step=0.01, per_row=0.0, per_context=0.0, per_prompt_token=0.0)
    assert RegenShape(cost, [[(50, 201)] * 4], 4, 4, 1).seconds(6) == pytest.approx((2 * 200 + 2) * 0.01)
    shape = RegenShape(cost, [[(50, 201), (50, 11), (50, 11), (50, 11)]], samples=4, batch_size=4, workers=1)
    assert shape.seconds(4) == pytest.approx(2.01)
    probe = dict(regenerate_tokens_per_s=234 / 2.01, answer_tokens=234 / 4, cached_spans=((0, 4),),
                 capture_tokens_per_s=1e9, train_tokens_per_s=1e9)
    by_rate = plan(**probe)
    by_shape = make_plan(1200, 60, rates(**probe), Schedule(2, 1, 1.0, 50, 50), shape)
    assert by_shape.regenerate_s == shape.seconds(by_shape.conversations - 4)
    assert by_shape.conversations > 3 * by_rate.conversations
    left = 1200 * (1 - MARGIN) - 60 - 60 - 10
    assert by_shape.total_s <= 1200 * (1 - MARGIN) and shape.seconds(by_shape.conversations - 3) > left - 1


def test_slower_rates_buy_fewer_conversations_and_a_tiny_budget_keeps_a_minimum():
    fast = plan()
    slow = plan(regenerate_tokens_per_s=50.0, train_tokens_per_s=250.0)
    assert slow.conversations < fast.conversations * 0.6
    assert plan(60, 50).conversations == MIN_CONVERSATIONS


def test_a_smallest_plan_over_the_budget_stops_in_one_line_already_from_a_lower_bound():
    """What the probes measured so far (the stages not yet probed free) already shows the smallest
    plan over the budget: the job stops there, saying "at least", instead of probing on."""
    cfg = compose_root(["+head=eagle3", "budget=10m"])
    slow = rates(regenerate_tokens_per_s=1.0, evaluate_s=0.0)  # 48 x 200 answer tokens: 160 min
    with pytest.raises(UserError) as stopped:
        fitting_plan(cfg, 60, slow, None, bound=True)
    line = str(stopped.value)
    assert line.startswith("budget=10m: even the smallest plan (48 conversations, 2 epochs) takes at least ")
    assert "regenerate alone ~160 min; it would fit with budget=" in line and "\n" not in line
    assert fitting_plan(cfg, 60, rates(), None).conversations > MIN_CONVERSATIONS  # fast: a plan


def test_validation_and_saves_are_paid_at_their_cadence():
    """A slow validation (it grows with the data) and heavy saves buy fewer conversations, and
    the plan still fits: its training share counts them."""
    costs = dict(validate_s_per_token=1e-3, save_best_s=5.0, checkpoint_s=10.0)
    bare, costly = plan(train_share=0.9), plan(train_share=0.9, **costs)
    assert costly.conversations < bare.conversations
    assert 1200 * (1 - MARGIN) - 10 < costly.total_s <= 1200 * (1 - MARGIN)
    r, sched = rates(**costs), Schedule(2, 1, 0.9, 50, 50)
    # 1,000 rows: 540,000 trained tokens = 540 steps at 1,080 s; ~10.8 validations of 30,000
    # tokens (30 s + 5 s) and ~10.8 checkpoints (10 s), plus the last step's
    assert train_cost(r, 1000, sched) == (pytest.approx(1080 + 540 / 50 * 45 + 45), 50)


def test_decoded_validation_is_priced_at_the_validation_cadence():
    """Each validation that decodes pays `Rates.val_decode_s` once, whatever the split's size."""
    r = rates(val_decode_s=6.0)
    bare, decoding = Schedule(2, 1, 0.9, 50, 50), Schedule(2, 1, 0.9, 50, 50, decodes=True)
    # 1,000 rows: 540 steps, a validation every 50 and one at the last
    assert train_cost(r, 1000, decoding)[0] == pytest.approx(train_cost(r, 1000, bare)[0] + 540 / 50 * 6 + 6)
    assert val_decode_cost(r, 1000, decoding) == val_decode_cost(r, 1000, bare) == 11 * 6
    assert plan(val_decode_s=6.0).conversations == plan().conversations  # a schedule that decodes none


def test_the_default_decodes_only_under_its_share_of_the_budget():
    """`optim.val_decode_prompts=null`: planned, and counted in training, where its validations
    cost at most `VAL_DECODE_SHARE` of the budget, with the most prompts that fit where all 8 do
    not, down to `MIN_VAL_DECODE_PROMPTS`; else the plan goes without it (and says what it would
    have cost). A number the user gave is planned whatever it costs."""
    cfg = compose_root(["+head=eagle3", "budget=20m"])
    cheap = fitting_plan(cfg, 60, rates(val_decode_s=2.0), None)
    assert cheap.decodes and 0 < cheap.val_decode_s <= VAL_DECODE_SHARE * 1200
    assert cheap.conversations < fitting_plan(cfg, 60, rates(), None).conversations  # it is paid for
    assert cheap.decode_prompts == 8 and "(decoded validation of 8 prompts ~" in cheap.line()
    # 8 prompts over the share: the most prompts that fit it, at an eighth of the price each
    fewer = fitting_plan(cfg, 60, rates(val_decode_s=100.0), None)
    eight = make_plan(1200, 60, rates(val_decode_s=100.0), schedule(cfg, 2), None, 8)
    assert eight.val_decode_s > VAL_DECODE_SHARE * 1200
    assert MIN_VAL_DECODE_PROMPTS <= fewer.decode_prompts < 8
    n = fewer.decode_prompts
    assert fewer.val_decode_s <= VAL_DECODE_SHARE * 1200 < fewer.val_decode_s * (n + 1) / n  # the most
    dear = fitting_plan(cfg, 60, rates(val_decode_s=200.0), None)  # not even 4 fit: none
    assert not dear.decodes and dear.val_decode_s > VAL_DECODE_SHARE * 1200
    assert "decoded validation" not in dear.line()
    assert dear.conversations == fitting_plan(cfg, 60, rates(), None).conversations
    # a budget whose smallest plan fits only without it: decoding goes, the run is not refused
    tight = dict(val_decode_s=30.0, evaluate_s=950.0)
    assert make_plan(1200, 60, rates(**tight), schedule(cfg, 2), None, 4).total_s > 1200
    assert not fitting_plan(cfg, 60, rates(**tight), None).decodes
    chosen = derive(cfg, {"optim.val_decode_prompts": 8})
    assert fitting_plan(chosen, 60, rates(val_decode_s=100.0), None).decodes  # the user's: kept, paid
    off = derive(cfg, {"optim.val_decode_prompts": 0})
    assert not fitting_plan(off, 60, rates(val_decode_s=2.0), None).decodes


def test_a_long_planned_run_validates_about_ten_times_and_an_explicit_cadence_wins():
    costs = dict(validate_s_per_token=1e-3, save_best_s=5.0, checkpoint_s=10.0)
    r = rates(**costs)
    # 10,000 rows: 5,400 steps; planned, every 540 steps (10 validations) instead of every 50
    seconds, every = train_cost(r, 10_000, Schedule(2, 1, 0.9, None, 50))
    assert every == 540 and seconds == pytest.approx(10_800 + 5400 / 540 * 305 + 5400 / 50 * 10 + 315)
    assert train_cost(r, 100, Schedule(2, 1, 0.9, None, 50))[1] == 50  # short runs: every 50
    assert train_cost(r, 10_000, Schedule(2, 1, 0.9, 50, 50))[1] == 50  # optim.val_every given
    big = dict(budget_s=36_000, train_share=0.9, **costs)
    planned = make_plan(36_000, 60, r, Schedule(2, 1, 0.9, None, 50))
    assert planned.val_every > 50 and planned.conversations > plan(**big).conversations


def test_the_recheck_trims_steps_and_grows_epochs_only_when_data_ran_short():
    # an epoch of 10 steps at 2 s a step; the last step's validation and saves 10 s
    assert fit_steps(50, 2.0, 10.0, 10, 2, short_of_data=False) == (2, 20)
    assert fit_steps(40, 2.0, 10.0, 10, 2, short_of_data=False) == (2, 15)  # trimmed
    assert fit_steps(0, 2.0, 10.0, 10, 2, short_of_data=False) == (2, 1)  # at least one step
    assert fit_steps(100, 2.0, 10.0, 10, 2, short_of_data=True) == (MAX_EPOCHS, 10 * MAX_EPOCHS)
    assert fit_steps(70, 2.0, 10.0, 10, 2, short_of_data=True) == (3, 30)


def test_the_plan_record_is_frozen_reads_back_and_decides_the_sizes(tmp_path):
    """The record a resumed run follows: plan.json's JSON reads back as the record written (the
    cached spans as tuples again), the re-check is a new record, not an edit of the old one, and
    a plan.json this version did not write is refused in one line."""
    planned = PlanRecord(plan(cached_spans=((0, 5), (9, 12))), rates(cached_spans=((0, 5), (9, 12))))
    optim = OptimConfig(epochs=planned.plan.epochs, val_every=50)
    checked = decide_recheck(planned.plan, planned.rates, left_s=30.0, per_epoch=10, samples=1,
                             train_tokens=10_000, val_tokens=0, optim=optim)
    assert checked.short_of_data and checked.steps == 15  # 1,000 tokens a step at 500 tokens/s: 15 in 30 s
    decoding = dataclasses.replace(planned.rates, val_decode_s=5.0)  # 5 s at the last step, 0.1 s a step
    assert decide_recheck(planned.plan, decoding, 30.0, 10, 1, 10_000, 0, optim).steps == 15  # none decoded
    assert decide_recheck(planned.plan, decoding, 30.0, 10, 1, 10_000, 0,
                          dataclasses.replace(optim, val_decode_prompts=8)).steps == 11  # 25 s at 2.1 s
    rechecked = dataclasses.replace(planned, recheck=checked)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rechecked.plan = None
    assert planned.recheck is None and planned.sizes(1).max_steps == 0
    sizes = rechecked.sizes(1)
    assert sizes.max_steps == 15 and sizes.conversations == planned.plan.conversations
    stopped = dataclasses.replace(rechecked, recheck=dataclasses.replace(checked, stopped_at=7))
    assert stopped.sizes(1).max_steps == 7
    again = PlanRecord.from_dict(json.loads(json.dumps(stopped.as_dict())), "plan.json")
    assert again == stopped
    with pytest.raises(UserError, match="^plan.json: not a plan this version"):
        PlanRecord.from_dict({"plan": {"conversations": 3}, "rates": {}}, "plan.json")




def test_a_warm_cache_still_times_regeneration(tiny_llama_dir, tmp_path):
    """The regeneration probe passes over the conversations the cache holds, wherever they are,
    and answers as many new ones as a cold probe: a rate left unknown priced regeneration free,
    and cached conversations counted as the first n (a long-context run had 155 cached, scattered
    by a killed multi-turn run) had it regenerate three times what it planned."""
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in conversations(3 * PROBE_SAMPLES)))
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path / "cache", "data.regenerate.enabled=true",
                           "data.regenerate.max_new_tokens=4", "data.regenerate.batch_size=8")
    target = resolve_target(cfg)
    cold = regeneration_probe(cfg, target, tmp_path / "run", EAGLE3)
    assert cold.cached == ((0, PROBE_SAMPLES),) and 0 < cold.tokens_per_s < float("inf")
    cache = regen_cache_file(cfg, target.identity, target.chat_template)
    # keep the answers at even positions (uid: the source's line number), as a killed multi-turn
    # run leaves them scattered
    lines = cache.read_text().splitlines(keepends=True)
    cache.write_text("".join(line for line in lines if int(json.loads(line)["uid"]) % 2 == 1))
    evens = tuple((i, i + 1) for i in range(0, PROBE_SAMPLES, 2))
    assert cached_spans(cfg, target.chat_template, read_cache(cache)) == evens
    assert uncached_prefix(evens, PROBE_SAMPLES) == 3 * PROBE_SAMPLES // 2
    warm = regeneration_probe(cfg, target, tmp_path / "run", EAGLE3)
    assert warm.cached == ((0, 3 * PROBE_SAMPLES // 2),) and 0 < warm.tokens_per_s < float("inf")
    assert warm.shape is not None
    assert len(read_cache(cache)) == 3 * PROBE_SAMPLES // 2


def test_the_training_probe_prices_conversations_not_rows(tiny_llama_dir, tmp_path):
    """A template that rewrites history makes a row per turn: the plan counts conversations, so
    the probe's tokens are per conversation (priced per row, an 8k run's capture came out 40%
    short: 124 conversations were 169 rows)."""
    template = tmp_path / "counted.jinja"
    template.write_text(
        "{{ messages | length }}{% for m in messages %}{{ m['role'] + ':' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    source = tmp_path / "chats.jsonl"
    two_turns = [{"conversations": [{"from": "human", "value": f"Name a colour, {i}."},
                                    {"from": "gpt", "value": "Blue " * (1 + i % 5)},
                                    {"from": "human", "value": "And another?"},
                                    {"from": "gpt", "value": "Red " * (1 + i % 3)}]}
                 for i in range(PROBE_SAMPLES)]
    source.write_text("".join(json.dumps(r) + "\n" for r in two_turns))
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path / "cache", f"data.chat_template={template}",
                           "data.max_turns=0")
    target = resolve_target(cfg)
    data = prepare(derive(cfg, {"data.max_samples": PROBE_SAMPLES}), target=target)
    assert data.samples == 2 * PROBE_SAMPLES  # a row per turn
    probed = train_probe(cfg, target, tmp_path / "run", PROBE_SAMPLES, EAGLE3)
    assert probed.row_tokens == pytest.approx(data.tokens / PROBE_SAMPLES)
    assert probed.val_decode_s > 0  # the default decoded validation, timed at the probe's last step


def test_a_second_run_of_the_same_settings_plans_with_the_first_runs_rates(tiny_llama_dir, tmp_path,
                                                                           monkeypatch, capsys):
    """The probes' rates are kept under everything they depend on: a second run that differs only
    in what changes no rate (run_dir, budget, logging) plans with them without probing, the
    regeneration cache read afresh; another head, another world, another machine or another
    file measure."""
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in conversations(3 * PROBE_SAMPLES)))
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path / "cache", "data.regenerate.enabled=true",
                           "data.regenerate.max_new_tokens=4", "budget=20m")
    target = resolve_target(cfg)
    shape = RegenShape(StepCost(0.01, 0.0, 1e-6, 1e-5), [[(12, 4), (9, 4)]], 2, 8, 1, 1.02)
    first = rates(cached_spans=((0, 3),), probe_s=240.0, regenerate_step_cost={"per_step": 0.01})
    path = reuse.keep(cfg, target, 1, first, shape)
    assert path.parent == tmp_path / "cache" / "plans"

    def refused(*args):
        raise AssertionError("probed again")

    monkeypatch.setattr(trainer.plan, "measure", refused)
    second = derive(cfg, {"run_dir": str(tmp_path / "second"), "budget": "30m", "logging.progress": True})
    again, again_shape = trainer.plan.probed_rates(second, target, 0.0, EAGLE3)
    assert again == dataclasses.replace(first, cached_spans=(), probe_s=0.0)  # the cache holds none now
    assert again_shape == shape
    assert str(path) in capsys.readouterr().out
    assert reuse.kept(derive(cfg, {"head.ttt_length": 2}), target, 1) is None
    assert reuse.kept(cfg, target, 2) is None  # two ranks trained another probe
    monkeypatch.setattr(reuse, "machine", lambda: {"cpu": "another"})
    assert reuse.kept(cfg, target, 1) is None
    monkeypatch.undo()
    path.write_text("{")  # cut off: measured again, not an error
    assert reuse.kept(cfg, target, 1) is None
