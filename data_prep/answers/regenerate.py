"""Replace assistant turns with the target's own answers, so the head learns what it will draft.

The data is token ids, not text: each turn is the prompt ids the chat template rendered
(generation prompt and `data.chat_template_kwargs` included) and the ids the target generated,
through its stop token; the loss mask is exactly the generated ids and nothing re-renders an
answer's text. A multi-turn conversation is answered turn by turn in the context the template
gives that turn at serving time (Qwen3's history without earlier reasoning, gpt-oss's without the
analysis channel); `template.build_rows` keeps one row per conversation where the template only
appends, one per turn where it rewrites history.

Generation was the slowest stage of data prep, so it runs on `regen_engine` (continuous batching
over a static KV cache), on vLLM in this process, or on the user's running servers of the target
(`regen_server`: many GPUs or nodes), one `Answerer` each, and it is resumable: every finished
conversation is appended to a JSONL cache (ids, and the answers' text for reading), and a rerun
skips the ids already there.
Runs that share the cache (a sweep started together) take turns under a lock file beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from conf.files import build_lock, lock_path
from conf.schema import RegenerateConfig
from data_prep.answers.regen_cost import StepCost
from data_prep.answers.regen_engine import EngineTimings, generate
from data_prep.answers.regen_server import ServerAnswerer
from data_prep.conversations.ranks import Ranks
from data_prep.conversations.sources import Sample, answer_uid
from data_prep.stats import PrepStats
from data_prep.target import Target
from data_prep.template import ChatTemplate, Message, TemplateError, Turn, note_refusal, parse_answer


@dataclass
class _Pending:
    sample: Sample
    system: list[Message]
    users: list[Message]
    turns: list[dict] = field(default_factory=list)  # {"prompt_ids", "answer_ids", "answer"}

    def prompt(self) -> list[Message]:
        """The next turn's conversation: system prompt, each answered user turn with the target's
        answer (as a message: the template decides what of it history keeps), the next user turn."""
        msgs = list(self.system)
        for user, turn in zip(self.users, self.turns):
            msgs += [user, parse_answer(turn["answer"])]
        return msgs + [self.users[len(self.turns)]]


def read_cache(path: Path, repair: bool = True) -> dict[str, list[dict]]:
    """Finished conversations' turns by uid; a torn last line (a killed run) is cut off the file
    when `repair` (only the holder of its lock may: another run may be writing that line)."""
    done: dict[str, list[dict]] = {}
    if not path.exists():
        return done
    good = 0
    with open(path, "rb") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            done[row["uid"]] = row["turns"]
            good += len(line)
    if repair and good != path.stat().st_size:
        os.truncate(path, good)
    return done


def answer_text(tok, ids: list[int], stop_ids: frozenset[int]) -> str:
    """An answer's text as history shows it: special tokens kept (gpt-oss channels), the stop
    token dropped."""
    return tok.decode(ids[:-1] if ids and ids[-1] in stop_ids else ids, skip_special_tokens=False)


def cached_turns(turns: list[dict]) -> list[Turn]:
    return [Turn(t["prompt_ids"], t["answer_ids"]) for t in turns]


def turn_seed(uid: str, turn: int) -> int:
    """A sampled answer's seed: a function of the sample and its turn only, so that the answer
    does not depend on which other prompts shared its batch or on how often the run was resumed."""
    return int(hashlib.sha256(f"{uid}:{turn}".encode()).hexdigest()[:8], 16)


class KeptStates(Protocol):
    """Where draftsmith's engine hands each answered conversation's hidden states at `layers` (one
    pass: capture's `data_prep.states.onepass.StateStore`). A protocol, so that answers, the
    earlier stage, name no module of the states stage that keeps them."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    def keep(self, ids: list[int], states: torch.Tensor) -> None: ...


class Answerer(Protocol):
    """A regeneration backend: answers one round of prompts, calling `on_finish(i, ids)` on the
    caller's thread as each answer is done (ids through the stop token)."""

    def __call__(self, prompts: list[list[int]], eos: set[int], seeds: list[int],
                 on_finish: Callable[[int, list[int]], None]) -> None: ...

    def postfix(self) -> dict[str, str]:
        """What the progress bar shows besides the overall rate."""
        ...

    def step_cost(self) -> StepCost | None:
        """The cost of one decode step fitted from the steps it took (`data_prep.answers.regen_cost`),
        which the time budget replays for a larger regeneration; None where its steps are not
        seen (vLLM, servers) or it took none."""
        ...


@dataclass
class EngineAnswerer:
    """`backend=hf`: draftsmith's continuous-batching engine on the transformers model;
    `matmul_dtype` is the precision of its linear layers (`data_prep.linears`)."""

    model: Any
    cfg: RegenerateConfig
    matmul_dtype: torch.dtype | None = None
    states: KeptStates | None = None  # keeps each answered conversation's states (one pass)
    timings: EngineTimings = field(default_factory=EngineTimings)  # every round's steps

    def __call__(self, prompts, eos, seeds, on_finish) -> None:
        c, keep = self.cfg, self.states
        generate(self.model, prompts, batch_size=c.batch_size, workers=c.workers, on_finish=on_finish,
                 timings=self.timings,
                 matmul_dtype=self.matmul_dtype, max_new_tokens=c.max_new_tokens, eos_token_ids=eos,
                 temperature=c.temperature, top_p=c.top_p, seeds=seeds,
                 kept_layers=keep.layers if keep else (),
                 on_states=(lambda i, ids, states: keep.keep(ids, states)) if keep else None)

    def postfix(self) -> dict[str, str]:
        return {}

    def step_cost(self) -> StepCost | None:
        return StepCost.fit(self.timings)


@dataclass
class VllmAnswerer:
    """`backend=vllm`: vLLM's offline engine in this process, on the target's folder and dtype."""

    target_path: str
    dtype: torch.dtype
    cfg: RegenerateConfig

    def __call__(self, prompts, eos, seeds, on_finish) -> None:
        from data_prep.answers.regen_vllm import vllm_generate

        c = self.cfg
        answers = vllm_generate(self.target_path, prompts, dtype=self.dtype, max_new_tokens=c.max_new_tokens,
                                eos_token_ids=eos, temperature=c.temperature, top_p=c.top_p, seeds=seeds)
        for i, ids in enumerate(answers):
            on_finish(i, ids)

    def postfix(self) -> dict[str, str]:
        return {}

    def step_cost(self) -> None:
        return None


def backend_answerer(cfg: RegenerateConfig, target: Target, matmul_dtype: torch.dtype | None,
                     states: KeptStates | None = None) -> Answerer:
    """The configured backend for `target`; only `hf` loads the target's weights here, and keeps
    the answered conversations' states in `states` where given (`data_prep.states.onepass`)."""
    if cfg.backend == "server":
        return ServerAnswerer(cfg, target.name, target.path, target.tokenizer)
    if cfg.backend == "vllm":
        return VllmAnswerer(target.path, target.dtype, cfg)
    return EngineAnswerer(target.model, cfg, matmul_dtype, states)


def regenerate(
    samples: list[Sample],
    answerer: Callable[[], Answerer],
    tpl: ChatTemplate,
    cfg: RegenerateConfig,
    max_length: int,
    cache_file: Path,
    stats: PrepStats,
    progress: Callable | None = None,
) -> list[tuple[str, list[Turn]]]:
    """(uid, turns) of every sample answered by the target (`cfg.num_samples` per prompt, each
    its own sample with uid `answer_uid(uid, k)`), in input order; reuses and extends `cache_file`.

    `answerer` makes the backend (`backend_answerer`), called only when some answer is missing
    from the cache: a cached run neither loads the target nor reaches a server.
    A turn is answered only when its prompt leaves room for `max_new_tokens` within
    `max_length`; later turns of that conversation are dropped (they would be truncated away).
    Conversations are written to the cache as they finish, so a killed run loses only the ones
    in flight. Runs sharing `cache_file` take turns under its lock.
    """
    # One run at a time per cache: a run that waited then finds the other's answers cached
    # instead of computing them again, every run trains on the same answer for a prompt (bf16
    # GEMMs may break near-ties by batch), and `read_cache` may cut a torn line (no other writer).
    with build_lock(lock_path(cache_file), f"regeneration cache {cache_file}"):
        done = read_cache(cache_file)
        wanted = wanted_answers(samples, cfg)
        todo = []
        for s in wanted:
            if s.uid not in done:
                system = [m for m in s.messages[:1] if m["role"] == "system"]
                todo.append(_Pending(s, system, [m for m in s.messages if m["role"] == "user"]))
        stats.regenerated_from_cache += len(wanted) - len(todo)
        budget = max_length - cfg.max_new_tokens
        answer = answerer() if todo else None
        turns = sum(len(p.users) for p in todo)
        bar = progress(total=turns, unit="answer", desc="regenerate") if progress and todo else None
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        started, new_tokens = time.perf_counter(), 0
        with open(cache_file, "a", encoding="utf-8") as out:

            def finish(p: _Pending, refused: bool = False) -> None:
                dropped = len(p.users) - len(p.turns)  # refused by the template, else too long
                if refused:
                    stats.turns_dropped_refused += dropped
                else:
                    stats.turns_dropped_too_long += dropped
                done[p.sample.uid] = p.turns
                out.write(json.dumps({"uid": p.sample.uid, "turns": p.turns}) + "\n")
                out.flush()

            while todo:  # one round per turn: each round answers every conversation's next turn
                ready = []
                for p in todo:
                    try:
                        ids = tpl.prompt_ids(p.prompt(), p.sample.tools)
                    except TemplateError as err:  # e.g. roles that must alternate
                        note_refusal(stats, tpl, p.sample.where or p.sample.uid, err)
                        finish(p, refused=True)
                        continue
                    if len(ids) > budget:
                        finish(p)
                    else:
                        ready.append((len(ids), p.sample.uid, ids, p))
                ready.sort(key=lambda r: (r[0], r[1]))  # similar lengths prefill together
                pending, todo = [(r[2], r[3]) for r in ready], []

                def answered(i: int, new: list[int], pending=pending, todo=todo) -> None:
                    nonlocal new_tokens
                    context, p = pending[i]
                    text = answer_text(tpl.tok, new, tpl.stop_ids)
                    p.turns.append({"prompt_ids": context, "answer_ids": new, "answer": text})
                    new_tokens += len(new)
                    stats.answers_cut_at_max_new_tokens += new[-1] not in tpl.stop_ids
                    if len(p.turns) < len(p.users):
                        todo.append(p)
                    else:
                        finish(p)
                    if bar is not None:
                        bar.update(1)
                        rate = f"{new_tokens / (time.perf_counter() - started):.1f}"
                        bar.set_postfix(tok_s=rate, **answer.postfix())

                seeds = [turn_seed(p.sample.uid, len(p.turns)) for _, p in pending]
                answer([r[2] for r in ready], set(tpl.stop_ids), seeds, answered)
        if bar is not None:
            bar.close()
        stats.regenerated_tokens += new_tokens
        stats.regenerate_seconds += round(time.perf_counter() - started, 2)
        if answer is not None and (cost := answer.step_cost()) is not None:
            stats.regenerate_step_cost = dataclasses.asdict(cost)
        return answered_turns(wanted, done, stats)


def wanted_answers(samples: list[Sample], cfg: RegenerateConfig) -> list[Sample]:
    """Every answer `samples` ask for: `cfg.num_samples` per prompt, uid `answer_uid(uid, k)`."""
    return [Sample(answer_uid(s.uid, k), s.messages, s.tools, s.where)
            for s in samples for k in range(cfg.num_samples)]


def answered_turns(wanted: list[Sample], done: dict[str, list[dict]],
                   stats: PrepStats) -> list[tuple[str, list[Turn]]]:
    """(uid, turns) of the `wanted` answers, in order, from the cache's `done`; those with no
    answered turn count as prompts too long."""
    stats.skipped_prompt_too_long += sum(1 for s in wanted if not done[s.uid])
    return [(s.uid, cached_turns(done[s.uid])) for s in wanted if done[s.uid]]


def part_file(cache_file: Path, rank: int) -> Path:
    """Rank `rank`'s part of the answer cache (`data_prep.conversations.ranks`), beside it."""
    return cache_file.with_name(f"{cache_file.stem}.part{rank}.jsonl")


def fold_parts(cache_file: Path) -> None:
    """Append every rank's part (a killed run's too) to the cache, the conversations it lacks,
    then delete the parts: no rank is writing when this runs."""
    parts = sorted(cache_file.parent.glob(f"{cache_file.stem}.part*.jsonl"))
    if not parts:
        return
    with build_lock(lock_path(cache_file), f"regeneration cache {cache_file}"):
        done = read_cache(cache_file)
        with open(cache_file, "a", encoding="utf-8") as out:
            for part in parts:
                for uid, turns in read_cache(part).items():
                    if uid not in done:
                        done[uid] = turns
                        out.write(json.dumps({"uid": uid, "turns": turns}) + "\n")
                out.flush()
                part.unlink()


# What a rank's share of regeneration counts (`regenerate_shares` sums them over the ranks); the
# prompts too long are counted once, over every answer, and the cache's answers before the run.
SHARE_FIELDS = ("regenerated_tokens", "answers_cut_at_max_new_tokens", "turns_dropped_too_long",
                "turns_dropped_refused", "conversations_refused_by_template")


def regenerate_shares(samples: list[Sample], answerer: Callable[[], Answerer], tpl: ChatTemplate,
                      cfg: RegenerateConfig, max_length: int, cache_file: Path, stats: PrepStats,
                      progress: Callable | None, ranks: Ranks) -> list[tuple[str, list[Turn]]]:
    """What `regenerate` returns, with several `ranks` answering at once
    (`data_prep.conversations.ranks`, step 1): each rank answers its prompts that the cache lacks
    into its own part, rank 0 folds the parts in, and every rank reads the whole cache; `stats`
    count every rank's share (tokens, cuts and drops summed; seconds: the slowest rank's, the
    stage's wall).

    Between the barriers no process of this run writes the cache, so the ranks read it without
    its lock (only another run's torn line may follow, left alone): under the lock the ranks
    would wait on each other's reading, one at a time. One process: `regenerate`."""
    if ranks.world == 1:
        return regenerate(samples, answerer, tpl, cfg, max_length, cache_file, stats, progress)
    if ranks.main:
        fold_parts(cache_file)  # what a killed run's ranks answered
    ranks.barrier()
    wanted = wanted_answers(samples, cfg)
    before = read_cache(cache_file, repair=False)
    mine = [s for s in samples if ranks.owns_prompt(s.uid)
            and any(answer_uid(s.uid, k) not in before for k in range(cfg.num_samples))]
    share = PrepStats()
    regenerate(mine, answerer, tpl, cfg, max_length, part_file(cache_file, ranks.rank), share, progress)
    ranks.barrier()
    if ranks.main:
        fold_parts(cache_file)
    ranks.barrier()
    shares = ranks.gather(share)
    for name in SHARE_FIELDS:
        setattr(stats, name, getattr(stats, name) + sum(getattr(s, name) for s in shares))
    stats.regenerate_seconds += max(s.regenerate_seconds for s in shares)
    stats.regenerated_from_cache += sum(1 for s in wanted if s.uid in before)
    return answered_turns(wanted, read_cache(cache_file, repair=False), stats)
