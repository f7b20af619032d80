"""`prepare(cfg)`: conversations -> regenerated answers -> captured shards + draft vocabulary.

Also the Hydra app `python -m data_prep.prepare +head=eagle3` (or `+head=medusa`). The head
decides what is captured: EAGLE-3 three auxiliary layers and the final one, Medusa the final
one, Medusa-2 joint training tokens only; where draftsmith's engine regenerates, it keeps the
states of what it answers and capture skips those conversations (`data_prep.states.onepass`). With
`data.hidden_states=online` nothing is captured: the shards hold ids and masks and the training
loop runs the target. Every stage is cached: the
finished folder and the regenerated answers (each keyed by what its contents depend on,
`data_prep.folders.keys`; answers not by `max_samples`, so growing the set reuses them) and, inside an
unfinished folder, each shard. Samples stream from the source through tokenisation
(`data_prep.conversations.rows`) to a `TokenSpill` on disk, then into shards (`data_prep.folders.build`).

Caches are shared by the runs of a sweep: a folder is built under a lock file beside it
(`<key>.lock`, `conf.files.build_lock`), so runs started together build it once and the others
reuse it; the regeneration cache has its own lock. Offline capture checks the free disk against
its known size before it starts, and a disk that still fills is one line; the partial folder
resumes. Under torchrun every rank regenerates and captures its share (`data_prep.conversations.ranks`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import hydra
from omegaconf import DictConfig

from conf.compose import hydra_main
from conf.errors import UserError, exit_on_user_error
from conf.files import build_lock, build_once, disk_full_is_one_line
from conf.schema import RootConfig, to_root_config
from data_prep.conversations.ranks import SINGLE, Ranks
from data_prep.conversations.sources import check_source_exists
from data_prep.folders.build import build_folder, built_folder
from data_prep.folders.folder import DataFolder
from data_prep.folders.keys import FolderKey, states_folder
from data_prep.states.capture import CaptureSpec
from data_prep.states.capture_engine import check_capture_backend
from data_prep.states.onepass import StateStore, engine_keeps, one_pass
from data_prep.target import Target, check_max_length, data_base, resolve_target
from data_prep.vllm_engine import check_vllm_backend
from heads.kinds import HeadKind, check_export_formats, head_kind


def capture_spec(cfg: RootConfig, kind: HeadKind, num_hidden_layers: int) -> CaptureSpec:
    """What the chosen head (`cfg.head`, of `kind`) trains on: the layers its kind captures, and
    the target's top-1 id where its kind asks for it (`heads.kinds`)."""
    aux, final = kind.captured_layers(cfg.head, num_hidden_layers)
    return CaptureSpec(aux, final, cfg.data.storage_dtype, kind.target_top)


def draft_vocab_size(cfg: RootConfig, kind: HeadKind, vocab_size: int) -> int | None:
    """The draft vocabulary's size, or None for a kind that drafts over the whole vocabulary."""
    return min(cfg.data.draft_vocab_size, vocab_size) if kind.draft_vocab else None


def check_source(cfg: RootConfig) -> None:
    """The data checks that need the outside world (the schema did the rest), before any model is
    loaded: a missing local source file or chat template, vLLM missing for a vllm backend, the
    capture backends' folder, and `target.device_map` with the `hf` engine.

    The engine is refused with a split target rather than taught to run on one: its slot caches
    are indexed with tensors on the input device and it samples where the logits land, so every
    step would cross devices, on a path no test here can run (no node with several GPUs); a
    target too large for one GPU regenerates faster in a server anyway (backend=server)."""
    check_source_exists(cfg.data)
    if cfg.data.regenerate.enabled and cfg.data.regenerate.backend == "hf":
        cfg.target.one_device("regeneration's hf engine (data.regenerate.backend=hf)",
                              "use data.regenerate.backend=server or vllm, or data.regenerate.enabled=false")
    template = cfg.data.chat_template
    if template and not Path(template).expanduser().is_file():
        raise UserError(f"data.chat_template={template!r}: no such file (expected a .jinja chat template)")
    if cfg.data.regenerate.enabled and cfg.data.regenerate.backend == "vllm":
        check_vllm_backend("data.regenerate.backend=vllm")
    check_capture_backend(cfg.data.capture)


# What a full disk during data prep leaves and how to go on.
DISK_FULL_THEN = (
    "free space (or set data.cache_dir to a larger disk, or use data.hidden_states=online) and run "
    "the same command again: it keeps the answers and shards written and resumes after them"
)


def state_store(cfg: RootConfig, target: Target, spec: CaptureSpec) -> StateStore | None:
    """The one-pass store for folders of `cfg` (None: no one pass there), the target's lm_head
    giving the top-1 once the engine has loaded it."""
    if not (engine_keeps(cfg) and spec.needs_forward):
        return None
    folder = states_folder(cfg, target.identity, spec)
    return StateStore(folder, spec, lambda: target.model.get_output_embeddings())


def prepare(cfg: RootConfig, target: Target | None = None, ranks: Ranks = SINGLE,
            keep_states: bool = False, kind: HeadKind | None = None) -> DataFolder:
    """Build (or reuse) the data folder for `cfg` and return it.

    `target`: the run's resolved `cfg.target` (`resolve_target`), so that a caller that holds it
    does not resolve it again; None resolves it here. Its weights load only if a stage needs
    them. `kind`: the record of `cfg.head`'s kind, as the command resolved it; None looks it up.
    Runs that prepare one folder at once build it once: the first under its lock, the
    others wait and reuse it. `ranks`: the processes of one torchrun that build it together
    (`data_prep.conversations.ranks`); every rank calls this and gets the folder. Regeneration keeps its
    states for capture where `one_pass(cfg)` (`data_prep.states.onepass`); the store is deleted once the
    folder is there, unless `keep_states`, with which the planner's probes (an online folder
    among them) keep what regeneration kept for the run's folder.
    """
    check_source(cfg)
    target = resolve_target(cfg) if target is None else target
    check_max_length(cfg.data.max_length, target.config)
    kind = head_kind(cfg.head.name) if kind is None else kind
    identity = target.identity
    spec = capture_spec(cfg, kind, identity["num_hidden_layers"])
    states = state_store(cfg, target, spec) if keep_states or one_pass(cfg) else None
    key = FolderKey(cfg, target, spec, draft_vocab_size(cfg, kind, identity["vocab_size"]))
    folder = _prepare(cfg, key, ranks, states)
    if states is not None and not keep_states and ranks.main:
        shutil.rmtree(states.folder, ignore_errors=True)  # in the shards now; a killed run's is kept
        with contextlib.suppress(OSError):  # `states/` goes with its last store; another run's keeps it
            states.folder.parent.rmdir()
    return folder


def _prepare(cfg: RootConfig, key: FolderKey, ranks: Ranks, states: StateStore | None) -> DataFolder:
    # auto reuses a folder of either mode: the choice was made when it was built.
    hidden = cfg.data.hidden_states
    modes = ("offline", "online") if hidden == "auto" else (hidden,)

    def build() -> DataFolder:
        with disk_full_is_one_line(data_base(cfg), DISK_FULL_THEN):
            return build_folder(key, modes, ranks, states)

    what, lock = f"data folder {key.folder(modes[0])}", key.sibling(".lock")
    if ranks.world == 1:
        return build_once(lock, what, lambda: built_folder(key, modes), build)
    # Several ranks build it together: rank 0 holds the lock for them all and tells them whether
    # the folder is there already (another run may have built it while rank 0 waited).
    with contextlib.ExitStack() as held:
        found = built_folder(key, modes) if ranks.main else None
        if ranks.main and found is None:
            held.enter_context(build_lock(lock, what))
            found = built_folder(key, modes)
        if ranks.from_main(found is not None):
            return found or built_folder(key, modes)
        return build()


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
@exit_on_user_error
def main(dict_cfg: DictConfig) -> None:
    """One process, or every rank under torchrun (`data_prep.conversations.ranks`)."""
    ranks = Ranks.from_env()
    try:
        prepare(to_root_config(dict_cfg), ranks=ranks)
    finally:
        ranks.close()


if __name__ == "__main__":
    # --help lists the keys data prep reads (the head: which layers it captures).
    hydra_main(main, check_export_formats, shows=("target", "data", "head", "logging.progress"))
