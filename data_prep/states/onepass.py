"""Regeneration and capture in one pass: the engine that writes an answer keeps its states.

Capture runs the target over every conversation once more after regeneration, though the
regeneration engine already ran the target over each of those tokens (the prompt in its prefill,
each answer token as the next step's input). With `data.capture.one_pass` (the `hf` engine and
the `hf` capture backend), the engine hands each answered conversation's kept layers to a
`StateStore` (`regen_engine.generate`'s `on_states`), which turns them into exactly the fields
capture stores (aux layers, the final state, the top-1 from the final state as stored) and keeps
them in a folder beside the data folder, one file per conversation, named by the hash of its token
ids. Capture then asks `OnePassCapturer`, which serves a row from the store when the row's ids are
a stored conversation's and runs the configured capture over the others only: answers that came
from the regeneration cache, rows cut at `max_length`, earlier turns of a conversation whose
history the template rewrites, states that did not come out finite (the forward names the
overflow). `prepare` deletes the store once the run's folder is built (the planner's probes
keep it for the run; a killed run's stays for the rerun).

The states are the engine's forwards', not capture's: bf16 GEMMs and the decode attention kernel
group the sums differently, so they equal capture's within bf16 noise, not bit for bit
(tests/unit/data_prep/test_onepass.py holds the bound; the top-1 agrees but at near-ties).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conf.files import atomic_write
from conf.schema import RootConfig
from data_prep.states.capture import TOP, Capturer, CaptureSpec, decode, encode, kept_fields, with_top


def ids_name(ids: list[int]) -> str:
    """A conversation's file name in the store: the hash of its token ids."""
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


@dataclass
class StateStore:
    """The kept fields of answered conversations, one safetensors file each under `folder`, as
    capture would store them (`spec`); `lm_head()` gives the top-1 where `spec` keeps it."""

    folder: Path
    spec: CaptureSpec
    lm_head: Callable[[], torch.nn.Module] | None = None  # the target's, once it is loaded
    served: int = field(default=0, init=False)  # tokens capture took from here

    @property
    def layers(self) -> tuple[int, ...]:
        """The transformers `hidden_states` indices the engine keeps: the spec's."""
        return self.spec.layers

    def keep(self, ids: list[int], states: torch.Tensor) -> None:
        """Store the fields of the conversation `ids` from its states [T, layers, H]; states
        that are not finite are left to capture, which names where they overflowed."""
        if not torch.isfinite(states).all():
            return
        spec = self.spec
        layers = {layer: states[:, k] for k, layer in enumerate(self.layers)}
        lm_head = self.lm_head() if spec.target_top else None
        fields = with_top(kept_fields(layers, spec, states.device), spec, lm_head)
        tensors = {TOP: fields.pop(TOP)} if TOP in fields else {}
        for name, value in fields.items():
            tensors |= encode(name, value, spec.groups(name), spec.storage_dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        atomic_write(self.folder / f"{ids_name(ids)}.safetensors", lambda p: save_file(tensors, str(p)))

    def fields(self, ids: list[int]) -> dict[str, torch.Tensor] | None:
        """The fields of the conversation `ids` as a `Capturer` gives them (float32, `TOP` int32),
        or None when it is not stored."""
        path = self.folder / f"{ids_name(ids)}.safetensors"
        if not path.exists():
            return None
        tensors = load_file(str(path))
        out = {k: decode(tensors, k) for k in ("aux_hidden", "final_hidden") if k in tensors}
        if TOP in tensors:
            out[TOP] = tensors[TOP]
        self.served += len(ids)
        return out


@dataclass
class OnePassCapturer:
    """A `Capturer` that serves the rows `store` holds and asks `fallback` (made on first need:
    the configured backend and the context its shards are captured in) for the rest."""

    store: StateStore
    fallback: Callable[[], tuple[Capturer, contextlib.AbstractContextManager]]
    _inner: tuple[Capturer, contextlib.AbstractContextManager] | None = None

    def __call__(self, samples: list[list[int]], names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        found = [self.store.fields(s) for s in samples]
        missing = [i for i, f in enumerate(found) if f is None]
        if missing:
            if self._inner is None:
                self._inner = self.fallback()
            capture, context = self._inner
            with context:
                computed = capture([samples[i] for i in missing], [names[i] for i in missing])
                for i, item in zip(missing, computed):
                    found[i] = item
        yield from found



def engine_keeps(cfg: RootConfig) -> bool:
    """Whether regeneration can keep states for capture (`data.capture.one_pass`): where the
    engine that answers is draftsmith's (`data.regenerate.backend=hf`), on the target capture
    would run (`data.capture.backend=hf`)."""
    d = cfg.data
    return (d.capture.one_pass and d.regenerate.enabled and d.regenerate.backend == "hf"
            and d.capture.backend == "hf")


def one_pass(cfg: RootConfig) -> bool:
    """Whether a run of `cfg` keeps regeneration's states: where it can and states are to be
    stored (not `data.hidden_states=online`, where the training loop runs the target)."""
    return engine_keeps(cfg) and cfg.data.hidden_states != "online"
