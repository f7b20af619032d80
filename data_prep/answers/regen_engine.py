"""Continuous-batching generation for regeneration: a static per-slot KV cache, prompts prefilled
in groups into free slots, and one decode forward over every busy slot per step.

`model.generate` on a left-padded batch keeps finished rows in the batch until the longest one
ends and grows its cache by concatenation every step, so on a CPU most of each step is spent on
rows that are done and on copying. Here the batch stays full: a row that ends frees its slot, and
the next prompts are prefilled into free slots at once. The K/V live in tensors allocated once,
[slots, kv_heads, max_len, head_dim] per layer; each row owns one slot and sees only its own
positions through an additive attention mask, so rows of any length share one forward. The
prefix all prompts share (the chat header) is prefilled once and copied into each slot. On a CPU
several engines run side by side in threads, one torch thread each, the matmuls run in bf16
or on weights packed once (`linears`), and decode attention runs on a kernel that reads each
row's cache once, only to its own length (`decode_attention`): a float32 CPU decode step spent
as long in PyTorch's attention as in all its matmuls. With bf16 matmuls the cached values are
bf16 (exactly what the projection made), and the objects that exist when the engine starts are
kept out of Python's garbage collector (`_heap_frozen`). Where a decode step's time went before
the bf16 values (2 cores, bf16 GEMMs, 128 rows per engine, perf): ~52% the GEMMs, a fifth of
them the lm_head; ~16% attention; ~19% PyTorch's small elementwise ops and casts; ~6% Python.
Prefills took ~13% of regeneration. What is left is mostly memory: on a Xeon with AMX (2 cores,
2 engines x 128 rows, `bench_regen`'s fitted cost) 35% of the time is reading the cache (~35 KB
a context position over 30 layers, float32 keys and bf16 values, at ~8 GB/s a core), 29% is per
step (each engine streams the weights and pays PyTorch's per-op cost once a step), 29% per row,
7% prefill. The cache read alone costs a new token ~0.85 ms a core, near the ~1 ms the bare
forward spends on a whole token, so one-token steps stay near 0.4 of the forward there; what would
close it is reading the cache once for several tokens (drafted tokens verified in one step), or
fewer bytes a position (bf16 keys, which changed answers: see `generate`).

The model is any Hugging Face causal LM with standard attention: `SlotCache` stands in for its
KV cache (the model calls only its `update`), and the masks and position ids are passed in, so
the architecture is not re-implemented. A slot keeps every position on every layer; a sliding
layer's mask (and the kernel) reads only its window, which is what transformers computes with
its rolling sliding-window caches. A target whose layers are neither full nor sliding attention
is refused (`masks.attention_layout`).

`data.regenerate.batch_size` rows are split over `data.regenerate.workers` engines (0: one per 32
rows on a CPU, one on a GPU). The linears follow `data.matmul_dtype` as all of data prep does: bf16
GEMMs on a CPU with native bf16, else float32 weights packed once. The attention kernel is built
once with the system's `cc` into the cache; without a compiler the engine keeps PyTorch's
attention, with the same answers, slower. `python scripts/bench_regen.py` measures the engine's
new tokens/s against the bare capture forward on the same conversations.
"""

from __future__ import annotations

import gc
import inspect
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from data_prep.answers.decode_attention import slot_attention
from data_prep.linears import DataLinears
from data_prep.masks import AttentionLayout, attention_layout
from data_prep.target import input_device


def prefill_mask(
    layout: AttentionLayout, lengths: torch.Tensor, width: int, dtype: torch.dtype, offset: int = 0
) -> torch.Tensor:
    """[k] prompt lengths -> [kinds, k, 1, width - offset, width] (see `AttentionLayout.masks`):
    the queries are positions offset..width-1 (the first `offset` are a shared prefix already in
    the cache); causal, no key past a prompt's end, and on sliding layers none out of the window.

    Padding queries (past the end) are never fully masked into NaN (the masks are finite); their
    K/V land past the prompt in the slot, where decoding overwrites them before use.
    """
    keys = torch.arange(width, device=lengths.device)
    keep = (keys[None, :] <= keys[offset:, None])[None] & (keys[None, None, :] < lengths[:, None, None])
    return layout.masks(keep[:, None], keys[offset:, None] - keys[None, :], dtype)


def decode_mask(
    layout: AttentionLayout, lengths: torch.Tensor, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """[n] cached lengths -> [kinds, n, 1, 1, width]: row i sees its positions 0..lengths[i] (the
    new token sits at lengths[i]), on sliding layers only the window's; the rest of the slot is
    stale or another prompt's padding."""
    keys = torch.arange(width, device=lengths.device)
    keep = keys[None, :] <= lengths[:, None]
    return layout.masks(keep[:, None, None], (lengths[:, None] - keys[None, :])[:, None, None], dtype)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the largest weight / noise. With Exp(1) noise, index i wins with
    probability w_i / sum(w) (the exponential race), and a float-level change in the weights
    flips the winner only on a near tie, which is why batched and lone runs draw the same."""
    return (weights / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(-1)


def noise_size(vocab: int) -> int:
    """Exp(1) draws one sampled token takes: a block of the vocabulary, then a token in it."""
    return 2 * (math.isqrt(vocab - 1) + 1)


def two_level_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of `probs` [n, V] with `noise` [n, noise_size(V)] of Exp(1).

    A race over the whole vocabulary needs V draws per token from the row's own generator, which
    costs more than a CPU decode step; racing sqrt(V) blocks by their mass, then the tokens of
    the winning block, is the same distribution from 2 sqrt(V) draws.
    """
    n, vocab = probs.shape
    size = noise.shape[1] // 2
    blocks = torch.nn.functional.pad(probs, (0, size * size - vocab)).view(n, size, size)
    block = race(blocks.sum(-1), noise[:, :size])
    token = race(blocks[torch.arange(n, device=probs.device), block], noise[:, size:])
    return block * size + token


def top_p_filter(probs: torch.Tensor, top_p: float, candidates: int = 256) -> torch.Tensor:
    """Zero every token outside the nucleus: the most likely tokens until their mass reaches top_p.

    Sorting a whole vocabulary costs about as much as a CPU decode step, so the nucleus is looked
    for among each row's `candidates` most likely tokens; only rows whose nucleus is larger (flat
    distributions) sort everything.
    """
    values, index = probs.topk(min(candidates, probs.shape[-1]), dim=-1)
    mass = values.cumsum(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, mass - values < top_p)
    flat = mass[:, -1] < top_p
    if flat.any():
        ranked, order = probs[flat].sort(dim=-1, descending=True)
        inside = ranked.cumsum(-1) - ranked < top_p
        keep[flat] = inside.scatter(-1, order, inside)
    return probs.masked_fill(~keep, 0.0)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, noise: torch.Tensor | None
) -> torch.Tensor:
    """Next token per row of `logits` [n, V]: argmax when temperature is 0, else a draw (with
    `noise`, see `two_level_race`) from the temperature-scaled distribution cut to its nucleus."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        probs = top_p_filter(probs, top_p)
    return two_level_race(probs, noise)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (a chat template's system header), short of
    the shortest prompt's last token, whose logits each prompt's prefill must still produce."""
    first, n = prompts[0], min(map(len, prompts)) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


PREFILL_TOKENS = 4096  # the padded tokens of one prefill forward, at most (activation memory)


def prefill_group(lengths: list[int], budget: int) -> int:
    """How many of the next prompts (`lengths`, longest first) to prefill in one forward: all of
    them while the padded tokens fit `budget` and no row is padded by over a quarter (a padded
    token costs as much as a real one)."""
    n = 1
    while n < len(lengths) and (n + 1) * lengths[0] <= budget and 4 * lengths[n] >= 3 * lengths[0]:
        n += 1
    return n


class SlotCache:
    """Static K/V per slot, in the shape of a transformers `Cache`: the attention layers call only
    `update(key_states, value_states, layer_idx, ...)`, with every mask and position passed in.

    Before each forward the engine says where that forward's K/V go: `prefill(slots, offset)`
    copies the first `offset` positions of the `source` slot (a prefix every prompt shares,
    computed once) into the given slots, writes a right-padded group after them and lets it
    attend to the prefix and among itself;
    `decode(positions, width)` writes one token per row of slots 0..n-1 at its own position and
    lets it attend to the first `width` positions of its slot. The tensors are allocated on the
    first update, from the K/V the model hands over, so heads, head size and device are the
    model's own; the dtype too, but for the values' when `value_dtype` is given (bf16: see
    `generate`). A prefill attends in the model's dtype; a decode step gets views of the cache.
    """

    def __init__(self, slots: int, max_len: int, value_dtype: torch.dtype | None = None):
        self.slots, self.max_len, self.value_dtype = slots, max_len, value_dtype
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._prefill_slots: torch.Tensor | None = None
        self._decode_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, positions)
        self._width = self._offset = self._source = 0

    def prefill(self, slots: torch.Tensor, offset: int = 0, source: int = 0) -> None:
        self._prefill_slots, self._decode_at = slots, None
        self._offset, self._source = offset, source

    def decode(self, positions: torch.Tensor, width: int) -> None:
        slots = torch.arange(len(positions), device=positions.device)
        self._prefill_slots, self._decode_at, self._width = None, (slots, positions), width

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V [rows, heads, T, dim]; return what this forward attends to."""
        if layer_idx not in self.keys:
            self.keys[layer_idx] = self._allocate(key_states, key_states.dtype)
            self.values[layer_idx] = self._allocate(value_states, self.value_dtype or value_states.dtype)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._prefill_slots is not None:
            where, start = self._prefill_slots, self._offset
            end = start + key_states.shape[2]
            stored = value_states.to(values.dtype)
            if not start:
                keys[where, :, :end], values[where, :, :end] = key_states, stored
                return key_states, value_states
            for store, new in ((keys, key_states), (values, stored)):
                store[where, :, :start] = store[self._source, :, :start]
                store[where, :, start:end] = new
            return keys[where, :, :end], values[where, :, :end].to(value_states.dtype)
        # One position per row: an index_put (scatter_ into a bf16 tensor copied the whole cache).
        slots, positions = self._decode_at
        keys[slots, :, positions] = key_states[:, :, 0]
        values[slots, :, positions] = value_states[:, :, 0].to(values.dtype)
        n = len(positions)
        return keys[:n, :, : self._width], values[:n, :, : self._width]

    def _allocate(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return like.new_zeros(self.slots, like.shape[1], self.max_len, like.shape[3], dtype=dtype)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (to close a gap)."""
        for store in (self.keys, self.values):
            for tensor in store.values():
                tensor[dst, :, :length] = tensor[src, :, :length]


class _Rows:
    """The slots' state: device tensors the forwards read, host lists the bookkeeping reads.

    Busy slots always form the prefix 0..n-1 when a decode step runs (`compact` closes gaps),
    so a step is one forward over views of the first n slots, with no gather.
    """

    def __init__(self, slots: int, device: torch.device):
        self.owner: list[int | None] = [None] * slots  # prompt index per slot
        self.length: list[int] = [0] * slots  # tokens in the slot's cache
        self.made: list[list[int]] = [[] for _ in range(slots)]  # tokens generated so far
        self.generator: list[torch.Generator | None] = [None] * slots  # the prompt's own, when sampling
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # next decode input
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # = length
        # With kept layers (`generate`'s `on_states`): each position's states so far, and whether
        # the answer is done and waits for the step that feeds its last token.
        self.states: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        self.closing: list[bool] = [False] * slots

    def busy(self) -> int:
        """n: one past the highest busy slot."""
        return max((i + 1 for i, o in enumerate(self.owner) if o is not None), default=0)

    def free(self) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o is None]

    def move(self, src: int, dst: int) -> None:
        for t in (self.tokens, self.positions):
            t[dst] = t[src]
        for column in (self.owner, self.length, self.made, self.generator, self.states, self.closing):
            column[dst] = column[src]
        self.release(src)

    def release(self, slot: int) -> None:
        """The slot is free again."""
        self.owner[slot], self.made[slot], self.generator[slot] = None, [], None
        self.states[slot], self.closing[slot] = [], False


def _cache_kwarg(model) -> str:
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class EngineTimings:
    """What the engines of one `generate` call timed (its `timings`): each decode step as (busy
    rows, cached tokens the rows attend to, seconds), each prefill as (prompt tokens, seconds).
    Regeneration fits the engine's step cost to them (`regen_cost`) into the data folder's stats,
    which the planner reads. List appends are atomic, so engines side by side need no lock."""

    decode: list[tuple[int, int, float]] = field(default_factory=list)
    prefill: list[tuple[int, float]] = field(default_factory=list)


def engine_shares(prompts: int, batch_size: int, workers: int) -> tuple[list[list[int]], int]:
    """The prompt indices each engine decodes (every workers-th, at most `batch_size` engines and
    one per prompt), and the slots of an engine (`batch_size` split evenly)."""
    workers = min(workers, batch_size, prompts)
    shares = [list(range(w, prompts, workers)) for w in range(workers)]
    return shares, min(batch_size // workers, len(shares[0]))


# Of the memory free when regeneration starts, the share the engines' caches may take: the rest
# holds the prefills' activations, the answers and the caller's data.
CACHE_SHARE = 0.5


def slot_bytes_per_token(config, dtype: torch.dtype, kept_layers: int) -> int:
    """What a slot holds per position: every layer's key and value (at most `dtype`'s bytes each:
    bf16 values take less), and the kept layers' float32 states when one pass keeps them."""
    t = config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    kv = 2 * t.num_hidden_layers * t.num_key_value_heads * head_dim * dtype.itemsize
    return kv + kept_layers * t.hidden_size * 4


def slots_that_fit(slots: int, max_len: int, per_token: int, free: int) -> int:
    """An engine's `slots`, fewer where its cache of `max_len` positions a slot at `per_token`
    bytes would pass `CACHE_SHARE` of `free` bytes (at least one: one row needs its cache).
    Long contexts need it: 128 slots of 8k positions of SmolLM2 take 48 GB in float32."""
    return max(1, min(slots, int(free * CACHE_SHARE) // (max_len * per_token)))


def engine_slots(model, slots: int, engines: int, max_len: int, kept_layers: int) -> int:
    """One of `engines` engines' `slots` for prompts and answers up to `max_len` positions, as
    the free memory, shared by the engines, bounds them now (`slots_that_fit`)."""
    per_token = slot_bytes_per_token(model.config, model.dtype, kept_layers)
    return slots_that_fit(slots, max_len, per_token, free_bytes(input_device(model)) // engines)


def planned_slots(model, batch_size: int, workers: int, max_len: int, kept_layers: int) -> int:
    """The rows `generate` decodes at once (over its `workers` engines): what the planner prices
    regeneration at (`trainer.plan`), since at long contexts it is far below `batch_size`."""
    return workers * engine_slots(model, batch_size // workers, workers, max_len, kept_layers)


def free_bytes(device: torch.device) -> int:
    """The memory free on `device`: the GPU's, else the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # accelerate's dependency

    return psutil.virtual_memory().available


def default_workers(model, batch_size: int) -> int:
    """Engines decoding side by side in one process, for `workers=0`. On a CPU, one thread per
    engine beats all threads on one engine (2 cores: +11% new tokens/s at 128 rows in all), as
    long as each keeps >= 32 rows for its matmuls; a GPU runs one engine."""
    if input_device(model).type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), batch_size // 32))


@contextmanager
def _heap_frozen() -> Iterator[None]:
    """Within: the objects that exist on entering (the model, transformers' modules: millions)
    are left out of Python's cyclic garbage collection, and put back on leaving. A decode step
    allocates thousands of short-lived objects, so the collector runs every few steps, and its
    full passes walked that whole heap: ~10% of regeneration's time on 2 cores. New cycles are
    still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _threads_split(workers: int) -> Iterator[None]:
    """Each worker thread started inside gets 1/workers of torch's threads (new threads read the
    global count), and the count is restored on leaving."""
    total = torch.get_num_threads()
    torch.set_num_threads(max(1, total // workers))
    try:
        yield
    finally:
        torch.set_num_threads(total)


def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos_token_ids: Iterable[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: list[int] | None = None,
    on_finish: Callable[[int, list[int]], None] | None = None,
    prefill_tokens: int = PREFILL_TOKENS,
    workers: int = 1,
    matmul_dtype: torch.dtype | None = None,
    kept_layers: tuple[int, ...] = (),
    on_states: Callable[[int, list[int], torch.Tensor], None] | None = None,
    timings: EngineTimings | None = None,
) -> list[list[int]]:
    """Each prompt's new token ids, through the first stop token (`eos_token_ids`), at most
    `max_new_tokens` in all.

    `batch_size` slots decode together, split over `workers` engines that run side by side in
    threads, each on every workers-th prompt (0: `default_workers`); fewer slots where their
    caches, sized for the longest prompt, would not fit the free memory (`slots_that_fit`). In
    an engine a finished row's slot is refilled from the queue before the next step, prompts
    longest first (the short ones finish the run, where the batch thins). `prefill_tokens` caps
    the padded tokens of one prefill forward (activation memory).
    Greedy when `temperature` is 0. Sampling needs `seeds`, one per prompt: a prompt draws from
    its own generator, seeded with its seed, so its output does not depend on the batch, slot or
    order it ran in. `on_finish(prompt_index, ids)` is called as each prompt finishes, so a
    caller can stream results out; calls never overlap. `matmul_dtype`: see `linears.DataLinears`
    (None: the model's own, with float32 weights packed for the decode steps on a CPU). With bf16
    linears on the decode kernel the cached values are bf16: a value leaves its projection as a
    bf16 number, so storing it so loses nothing, and a decode step, which spends a sixth of its
    time streaming the cache, reads a quarter fewer bytes. Keys are rotated after their
    projection, so they stay float32: rounding them left 5 of a sensitive tiny target's 32
    answers equal to `generate`'s with the same linears, where float32 keys leave 29.

    `on_states(prompt_index, ids, states)`, with `kept_layers` (indices into transformers'
    `hidden_states`): the hidden states [T, len(kept_layers), H] (float32, on the CPU) of every
    position of the prompt and its answer (`ids`, T of them), as the forwards that
    wrote the answer computed them, so that capture need not run the target over the
    conversation again (`data_prep.states.onepass`). The answer's last token is never an input when
    only the answer is wanted, so its row stays one more step to be fed (its draw unused):
    one extra row-step per answer. Called after that answer's `on_finish`, never overlapping.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    layout = attention_layout(model.config)  # refuses a target it cannot mask, before any forward
    if not prompts:
        return []
    shares, slots = engine_shares(len(prompts), batch_size, workers or default_workers(model, batch_size))
    kept = len(kept_layers) if on_states is not None else 0
    slots = engine_slots(model, slots, len(shares), max(map(len, prompts)) + max_new_tokens, kept)
    results: list[list[int]] = [[] for _ in prompts]
    eos = set(eos_token_ids)  # once: an iterator would be spent by the first engine
    lock = threading.Lock()

    def run(share: list[int]) -> None:
        def finished(k: int, ids: list[int]) -> None:
            with lock:
                results[share[k]] = ids
                if on_finish is not None:
                    on_finish(share[k], ids)

        def kept(k: int, ids: list[int], states: torch.Tensor) -> None:
            with lock:
                on_states(share[k], ids, states)

        with torch.inference_mode():  # the whole engine: its cache, rows and every forward
            _Engine(
                model,
                [prompts[i] for i in share],
                max_new_tokens=max_new_tokens,
                slots=min(slots, len(share)),
                eos=eos,
                temperature=temperature,
                top_p=top_p,
                seeds=None if seeds is None else [seeds[i] for i in share],
                on_finish=finished,
                on_states=kept if on_states is not None and kept_layers else None,
                kept_layers=kept_layers,
                prefill_tokens=prefill_tokens,
                counted=counted,
                layout=layout,
                value_dtype=torch.bfloat16 if counted and matmul_dtype == torch.bfloat16 else None,
                timings=timings,
            ).run()

    linears = DataLinears(model, matmul_dtype, rows=slots)  # packed for the decode steps' row count
    with linears, slot_attention(model) as counted, _heap_frozen():
        if len(shares) == 1:
            run(shares[0])
        else:
            with _threads_split(len(shares)), ThreadPoolExecutor(len(shares)) as pool:
                for done in [pool.submit(run, share) for share in shares]:
                    done.result()  # re-raises a worker's error
    return results


class _Engine:
    """One engine: `slots` rows decoding `prompts` with continuous batching (see `generate`).
    `counted`: decode forwards pass each row's cache length as `slot_counts` (`slot_attention`).
    `layout`: which positions each layer sees (`masks.attention_layout`). `value_dtype`: the cached
    values' (None: the model's). `on_states`: see `generate` (None: no states kept).
    Built and run under `torch.inference_mode()` (`generate`)."""

    def __init__(
        self,
        model,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        slots: int,
        eos: set[int],
        temperature: float,
        top_p: float,
        seeds: list[int] | None,
        on_finish: Callable[[int, list[int]], None],
        on_states: Callable[[int, list[int], torch.Tensor], None] | None,
        kept_layers: tuple[int, ...],
        prefill_tokens: int,
        counted: bool,
        layout: AttentionLayout,
        value_dtype: torch.dtype | None,
        timings: EngineTimings | None,
    ):
        self.model, self.prompts, self.slots = model, prompts, slots
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.temperature, self.top_p, self.seeds = temperature, top_p, seeds
        self.on_finish, self.on_states, self.kept_layers = on_finish, on_states, kept_layers
        self.prefill_tokens, self.counted, self.layout = prefill_tokens, counted, layout
        self.sampling = temperature > 0
        self.device = input_device(model)
        self.dtype = model.dtype
        # The prefix every prompt shares is prefilled once, into one spare slot past the busy ones,
        # and copied into each slot at admission (a quarter of a short chat prompt is its header).
        self.shared = shared_prefix(prompts) if len(prompts) > 1 else 0
        max_len = max(len(p) for p in prompts) + max_new_tokens
        self.cache = SlotCache(slots + (self.shared > 0), max_len, value_dtype)
        self.rows = _Rows(slots, self.device)
        self.queue = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        self.cache_kwarg = _cache_kwarg(model)
        self.timings = timings
        self.keeping = on_states is not None
        self.prefix_states: torch.Tensor | None = None  # the shared prefix's, [shared, layers, H], if keeping

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, keep, **counts
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's logits at its last kept position, and when `keeping` the kept layers'
        states of every input position [rows, T, layers, H] on the CPU (else None); `mask`: one
        per kind of layer (see `prefill_mask`); `counts`: `slot_counts` on decode steps."""
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self.layout.argument(mask),
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=self.keeping,
            **{self.cache_kwarg: self.cache},
            **counts,
        )
        states = None
        if self.keeping:
            states = torch.stack([out.hidden_states[i] for i in self.kept_layers], dim=2).float().cpu()
        return out.logits[:, -1], states

    def draw(self, logits: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        """The next token of the rows in slots `chosen` (their generators give the noise)."""
        noise = None
        if self.sampling:
            noise = torch.empty(len(chosen), noise_size(logits.shape[-1]))
            for row, slot in enumerate(chosen):
                noise[row].exponential_(generator=self.rows.generator[slot])
            noise = noise.to(self.device)
        return sample_next(logits, self.temperature, self.top_p, noise)

    def record(self, slot: int, token: int) -> None:
        """Append a token to the slot's answer (a stop token too: the answer's ids are what the
        target emits); free the slot when the answer is done, or when keeping states mark it
        closing: the next step feeds the last token for its states."""
        rows = self.rows
        made = rows.made[slot]
        made.append(token)
        if token in self.eos or len(made) == self.max_new_tokens:
            self.on_finish(rows.owner[slot], made)
            if self.keeping:
                rows.closing[slot] = True
            else:
                rows.release(slot)

    def close(self, slot: int) -> None:
        """Hand over a closing row's states (its last token's now among them) and free it."""
        rows = self.rows
        i = rows.owner[slot]
        self.on_states(i, self.prompts[i] + rows.made[slot], torch.cat(rows.states[slot]))
        rows.release(slot)

    def admit(self) -> None:
        """Prefill the next prompts of the queue into the free slots, lowest first, in groups."""
        prompts, queue, rows, shared, device = self.prompts, self.queue, self.rows, self.shared, self.device
        while queue and (free := rows.free()):
            group = prefill_group([len(prompts[i]) for i in queue[: len(free)]], self.prefill_tokens)
            index, chosen = queue[:group], free[:group]
            width = len(prompts[index[0]])
            del queue[:group]
            padded = [prompts[i][shared:] + [0] * (width - len(prompts[i])) for i in index]
            ids = torch.tensor(padded, device=device)
            lengths = torch.tensor([len(prompts[i]) for i in index], device=device)
            where = torch.tensor(chosen, device=device)
            self.cache.prefill(where, shared, self.slots)
            positions = torch.arange(shared, width, device=device).expand(group, width - shared)
            mask = prefill_mask(self.layout, lengths, width, self.dtype, shared)
            began = time.perf_counter()
            logits, states = self.forward(ids, positions, mask, (lengths - 1 - shared)[:, None])
            for row, (slot, i) in enumerate(zip(chosen, index)):
                rows.owner[slot], rows.length[slot] = i, len(prompts[i])
                if self.sampling:
                    rows.generator[slot] = torch.Generator().manual_seed(self.seeds[i])
                if self.keeping:
                    own = states[row, : len(prompts[i]) - shared]
                    rows.states[slot] = [own] if self.prefix_states is None else [self.prefix_states, own]
            new = self.draw(logits, chosen)
            rows.tokens[where], rows.positions[where] = new, lengths
            for slot, token in zip(chosen, new.tolist()):
                self.record(slot, token)
            if self.timings is not None:
                self.timings.prefill.append((int(lengths.sum()), time.perf_counter() - began))

    def compact(self) -> None:
        """Move the highest busy rows into the lowest free slots, so busy slots are a prefix."""
        rows = self.rows
        while (free := rows.free()) and free[0] < (n := rows.busy()):
            self.cache.move(n - 1, free[0], rows.length[n - 1])
            rows.move(n - 1, free[0])

    def prefill_prefix(self) -> None:
        """The shared prefix's K/V (and kept states), once, into the spare slot that admissions
        copy from."""
        shared, device = self.shared, self.device
        self.cache.prefill(torch.tensor([self.slots], device=device))
        ids = torch.tensor([self.prompts[0][:shared]], device=device)
        mask = prefill_mask(self.layout, torch.tensor([shared], device=device), shared, self.dtype)
        _, states = self.forward(ids, torch.arange(shared, device=device)[None], mask, 1)
        self.prefix_states = None if states is None else states[0]

    def step(self, n: int) -> None:
        """One decode forward over the busy slots 0..n-1."""
        rows = self.rows
        began = time.perf_counter()
        context = sum(rows.length[:n]) + n
        width = max(rows.length[:n]) + 1
        positions = rows.positions[:n]
        self.cache.decode(positions, width)
        mask = decode_mask(self.layout, positions, width, self.dtype)
        counts = {"slot_counts": positions + 1} if self.counted else {}
        logits, states = self.forward(rows.tokens[:n, None], positions[:, None], mask, 1, **counts)
        new = self.draw(logits, list(range(n)))
        rows.tokens[:n] = new
        rows.positions[:n] += 1
        for slot, token in enumerate(new.tolist()):  # the step's one read-back
            rows.length[slot] += 1
            if self.keeping:
                rows.states[slot].append(states[slot])
                if rows.closing[slot]:  # its last token was this step's input: done
                    self.close(slot)
                    continue
            self.record(slot, token)
        if self.timings is not None:
            self.timings.decode.append((n, context, time.perf_counter() - began))

    def run(self) -> None:
        """Decode every prompt: the shared prefix once, then refill free slots and step until
        no row is busy."""
        if self.shared:
            self.prefill_prefix()
        while True:
            self.admit()
            self.compact()
            if (n := self.rows.busy()) == 0:
                return
            self.step(n)
