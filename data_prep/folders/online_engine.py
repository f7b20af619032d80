"""Online training fed by servers: `data.hidden_states=online` with `data.capture.backend=server`.

The targets that need heads most do not fit one process, and online training is for data too
large to store: together, the training process cannot run the target. Here it holds the draft
alone, plus the few target tensors the head and the states need (its input embeddings, lm_head
and final norm: `held_parts`), and the serving engine computes every batch's hidden states: each
sample of the batch goes to the servers as data prep's server capture sends it
(`capture_engine.ServerCapturer`: the same requests, retries, dropped endpoints and one line when
none is left), and comes back as the fields `capture.checked_capture` gives the hf path: rounded
through `data.storage_dtype`, zero on padding, each packed document captured alone. A thread asks
for the next `data.capture.prefetch_batches` batches while the trainer trains (`data_prep.folders.prefetch`).

Nothing is lost when the servers go: the loop stops at the batch whose states did not come, in
one line, after its last checkpoint, and `resume=true` with a new server restarts from that
checkpoint's batch, asking for the states again (the folder holds the ids, the states are a
function of them). The states differ from the hf path's by the engine's float noise
(`capture_engine`), so the losses agree with offline training on a folder the same servers
captured within that noise (tests/e2e/test_capture_server.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch

from conf.schema import RootConfig
from data_prep.folders.prefetch import prefetched
from data_prep.folders.store import manifest_spec
from data_prep.states.capture import NONFINITE, TOP, Capturer, CaptureSpec, stored
from data_prep.states.capture_engine import ServerCapturer, final_norm, load_parts, needs_tail
from data_prep.target import Target

Batch = dict[str, torch.Tensor]
# What the line that stops training without servers says was kept, and how to go on.
TRAIN_RESUME = ("the checkpoints written so far are kept: start a server (scripts/serve_vllm.py) and run "
                "the same command with resume=true")


def served_online(cfg: RootConfig, hidden_states: str) -> bool:
    """Whether a run whose folder is in mode `hidden_states` gets its states from servers."""
    return hidden_states == "online" and cfg.data.capture.backend == "server"


def held_modules(target: Target, spec: CaptureSpec, skeleton: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of the target's `skeleton` that a process running no decoder layer holds: the
    input embeddings and lm_head (a head copies them), and the final norm where the states need
    it (`needs_tail`). Its own function so that the memory plan (`trainer.plan.memory`) prices
    exactly what `held_parts` loads."""
    tail = [final_norm(target, skeleton)] if needs_tail(spec, target.config.num_hidden_layers) else []
    return [skeleton.get_input_embeddings(), skeleton.get_output_embeddings(), *tail]


def holds_whole(cfg: RootConfig, spec: CaptureSpec, hidden_states: str, main: bool) -> bool:
    """Whether a training process (rank 0: `main`) holds the whole target while it trains, not
    only the parts its head reads (`held_parts`): where it computes the states (online, but
    from servers), trains the target itself (Medusa-2, which captures no states) or decodes
    with it (rank 0's decoded validation and evaluation), or trains on-policy (`optim.on_policy`,
    every rank). Offline the states are in the data
    folder, so every other rank holds a few tensors where it held 16 GB at 8B
    (`trainer.plan.memory` plans with this rule; `trainer.train.held_target` follows it)."""
    computes = hidden_states == "online" and cfg.data.capture.backend != "server"
    decodes = main and (cfg.val_decode_prompts > 0 or cfg.pipeline.evaluate)
    on_policy = cfg.optim.on_policy > 0  # the stage runs the target on the head's drafts
    return computes or not spec.needs_forward or decodes or on_policy


def held_parts(target: Target, spec: CaptureSpec) -> torch.nn.Module:
    """The target as a training process fed by servers holds it: its skeleton with
    `held_modules` loaded; no decoder layer, so a target of any size fits."""
    return load_parts(target, partial(held_modules, target, spec))


def documents(batch: Batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sample of a collated batch: a padded row holds one, its real
    tokens (`attention_mask`); a packed row one per restart of its `position_ids` at 0."""
    lengths = batch["attention_mask"].sum(1).tolist()
    positions = batch.get("position_ids")
    out = []
    for row, n in enumerate(lengths):
        starts = [0] if positions is None else (positions[row, :n] == 0).nonzero().flatten().tolist()
        out += [(row, a, b) for a, b in zip(starts, [*starts[1:], n])]
    return out


class ServedCapture:
    """The training loop's `Capture` (`trainer.loop`) from a `Capturer` of the servers: called on
    a batch, its fields now; `ahead(batches)`, each batch with its fields (and `NONFINITE`, which
    marks a batch as captured), `depth` batches ahead on a thread (0: none ahead)."""

    def __init__(self, capturer: Capturer, spec: CaptureSpec, depth: int):
        self.capturer, self.spec, self.depth = capturer, spec, depth

    def __call__(self, batch: Batch) -> Batch:
        """`batch`'s fields as `capture.checked_capture` gives them, on the batch's device; an
        overflow stops the run in one line naming the row (`EngineStates.fields`), so the flag
        is always clear."""
        moved = {k: v.to(batch["input_ids"].device) for k, v in self.host_fields(batch).items()}
        return {k: v.float() if v.is_floating_point() else v for k, v in moved.items()}

    def host_fields(self, batch: Batch) -> Batch:
        """`batch`'s fields on the host, as narrow as they are exact: bf16 where stored so (the
        rounded values are bf16's own; the loop widens them on the device, half the bytes across
        PCIe), float32 for fp8's decoded values, `TOP` int32."""
        ids = batch["input_ids"]
        docs = documents(batch)
        samples = [ids[row, a:b].tolist() for row, a, b in docs]
        names = [f"row {row} (tokens {a}..{b - 1}) of an online batch" for row, a, b in docs]
        narrow = torch.bfloat16 if self.spec.storage_dtype == "bfloat16" else torch.float32
        out: Batch = {}
        for (row, a, b), fields in zip(docs, self.capturer(samples, names)):
            for name, value in fields.items():
                if name != TOP:
                    value = stored(value, self.spec.groups(name), self.spec.storage_dtype).to(narrow)
                if name not in out:
                    out[name] = value.new_zeros((*ids.shape, *value.shape[1:]))
                out[name][row, a:b] = value
        out[NONFINITE] = torch.full((3,), -1, dtype=torch.long)
        return out

    def ahead(self, batches: Iterable[Batch], pin: bool | None = None) -> Iterator[Batch]:
        """Each batch with its fields (`host_fields`), asked for `depth` batches before the
        consumer needs them; pinned on the thread where `pin` (default: where CUDA is), so that
        the loop's `non_blocking` copy is one (from pageable memory it waits for the stream)."""
        if self.depth == 0:
            yield from batches
            return
        pin = torch.cuda.is_available() if pin is None else pin
        pinned = lambda b: {k: v.pin_memory() for k, v in self.host_fields(b).items()}  # noqa: E731
        work = pinned if pin else self.host_fields
        for batch, fields in prefetched(batches, work, self.depth):
            yield batch | fields


def served_capture(
    cfg: RootConfig, target: Target, manifest: dict, parts: torch.nn.Module
) -> ServedCapture | None:
    """For an online folder: the loop's capture from `data.capture.endpoints`, every server
    checked to serve the target first; `parts` from `held_parts`. None when the head reads no
    states (Medusa-2) or the folder holds them."""
    spec = manifest_spec(manifest)
    if manifest.get("hidden_states") != "online" or not spec.needs_forward:
        return None
    capturer = ServerCapturer(cfg, target, spec, parts, resume=TRAIN_RESUME)
    return ServedCapture(capturer, spec, cfg.data.capture.prefetch_batches)
