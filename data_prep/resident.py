"""One copy of the target's weights per process: the transformers model or a vLLM engine.

A vLLM engine reserves most of its device up front (92% of a GPU), so it refuses to start beside
a transformers copy of the same target, and at 8B the two do not fit one GPU together. A main
job may want both, one after the other: `data.regenerate.backend=vllm` answers with vLLM, the
planner's probes and the hf capture then run the transformers model, evaluation decodes with
it. Each holder names how it frees its copy when it takes the place (`take`), and whoever held
it before is released first: loading the model stops a running engine, starting an engine
drops a loaded model (`data_prep.target.Target.model`, `data_prep.vllm_engine.engine`). The
copy a later stage needs is loaded again on its first use.
"""

from __future__ import annotations

from collections.abc import Callable

_held: dict[str, Callable[[], None] | None] = {"release": None}


def take(release: Callable[[], None]) -> None:
    """Free the copy another holder keeps (its `release`), then record `release` as how this
    one's copy is freed. Releasing a copy already gone is a no-op for every holder."""
    previous = _held["release"]
    _held["release"] = release
    if previous is not None and previous != release:
        previous()
