"""Export a trained head for the serving engines: `python -m heads.export head=<path> format=<fmt>`.

Formats: `eagle3` (native LlamaForCausalLMEagle3 folder: vLLM, SGLang, TensorRT-LLM),
`speculators` (vLLM's one-command format), `gguf` (llama.cpp's EAGLE-3 draft, for the heads its
graph expresses), `medusa-vllm`, `medusa-tgi`, P-EAGLE's `peagle` and `peagle-speculators`, and
DFlash's and DSpark's vLLM folders and llama.cpp drafts (`<kind>`, `<kind>-speculators`,
`<kind>-gguf`). Each export is written to a temporary folder (`Layout.save`), reloaded by the
format's own strict reader and compared with the trained head (tensors, config, outputs) before it
is renamed into place; then a model card is added and, with `push_to_hub=<repo_id>`, the folder
is uploaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from conf.errors import UserError
from conf.files import disk_full_is_one_line, read_json, staged_dir
from conf.schema import EXPORT_DTYPES
from heads import kinds
from heads.export.card import PICTURE, CardFacts, hub_id, render, served_setting
from heads.export.check import verify_export
from heads.export.core import ExportContext
from heads.export.gguf_file import OF_DTYPE, storage_dtype
from heads.folder import TargetSpec, load_head, read_head_meta, run_config
from heads.record import HeadKind

DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}


def default_formats(kind: HeadKind, head: dict, target_layers: int | None = None) -> list[str]:
    """The formats `export.formats=null` writes: every one of the kind's that does not refuse the
    head (`Layout.refuses`: a llama.cpp draft takes only the heads llama.cpp's graph expresses).
    `head`: a saved head's config, or a command's `head.*` settings before it trains."""
    return [fmt for fmt, layout in kind.formats.items()
            if layout.refuses is None or layout.refuses(head, target_layers) is None]


def formats_for(head_path: str | Path, formats: list[str] | None) -> list[str]:
    """The formats to write for a head: those asked for, or its kind's defaults for it."""
    if formats:
        return list(formats)
    meta = read_head_meta(head_path)
    return default_formats(kinds.head_kind(meta["kind"]), meta["config"], meta["target"]["num_hidden_layers"])


def _verifier(spec: TargetSpec, target_model) -> tuple[str, list[str]]:
    name = hub_id(spec.name_or_path) or str(Path(spec.name_or_path).expanduser().resolve())
    if target_model is not None:
        return name, list(target_model.config.architectures or [])
    local = Path(spec.name_or_path).expanduser() / "config.json"
    return name, (read_json(local, "target").get("architectures", []) if local.exists() else [])


def check_out_dir(out: Path) -> None:
    """Refuse an `out` that is, or lies under, an existing file, before anything is written (the
    temporary folder beside it would be left behind when the rename fails)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"out={str(out)!r}: {existing} is a file; expected a folder to export into")


def export_head(
    head_path: str | Path,
    fmt: str,
    out_dir: str | Path,
    target_model=None,
    eval_json: str | Path | None = None,
    push_to_hub: str | None = None,
    dtype: str = "bfloat16",
    num_speculative_tokens: int = 3,
    license: str = "apache-2.0",
    gguf_type: str | None = None,
) -> tuple[Path, dict]:
    """Write `head_path` (a draftsmith head folder) to `out_dir` in format `fmt`, self-checked.

    Returns the folder and the report printed by the CLI (format, out, what the self-check
    compared, and the Hub commit with `push_to_hub`). `fmt` and `dtype` are taken as checked:
    `export.formats` / `export.dtype` / `export.gguf_type` by the config schema, the CLI's own
    `format=` by the CLI. `gguf_type` (None: `dtype`'s) is a llama.cpp GGUF's storage; other
    formats store `dtype`.
    `num_speculative_tokens` (`eval.num_speculative_tokens`) gives way to the best chain setting of
    `eval_json` where its sweep found one that pays (the card's serve lines carry it), and the
    kind's own count where the kind pins one (`served_tokens`).
    """
    kind, head_path, out = kinds.format_kind(fmt), Path(head_path), Path(out_dir)
    layout = kind.formats[fmt]
    check_out_dir(out)
    src_cfg, spec, src_tensors = load_head(head_path, kind.name)
    report = read_json(Path(eval_json), "eval") if eval_json else None
    # The evaluator's best chain setting, where one beat greedy decoding (`served_setting`);
    # else what it decoded with.
    best = served_setting(report)
    p_min = best["p_min"] if best else ((report or {}).get("settings") or {}).get("draft_p_min", 0.0)
    num_speculative_tokens = kind.served_tokens(src_cfg, best["k"] if best else num_speculative_tokens)
    if target_model is not None:
        spec.check(
            TargetSpec.from_model(target_model, spec.name_or_path), f"head={str(head_path)!r}"
        )
    verifier, arch = _verifier(spec, target_model)
    gguf_type = gguf_type or OF_DTYPE[dtype]
    ctx = ExportContext(dtype, num_speculative_tokens, verifier, arch, spec, gguf_type)
    gguf = layout.weights_file.endswith(".gguf")
    storage = storage_dtype(gguf_type) if gguf else DTYPES[dtype]
    config = layout.config(src_cfg, ctx)
    picture = Path(eval_json).with_name(PICTURE) if eval_json else None
    run = run_config(head_path)

    full = "free space and export again (nothing was written under it)"
    with disk_full_is_one_line(out.parent, full), staged_dir(out) as tmp:
        layout.save(tmp, layout.weights_file, config, layout.tensors(src_tensors, src_cfg, storage))
        where = f"format={fmt} out={str(out)!r}"
        q8_0 = gguf and gguf_type == "q8_0"
        check = verify_export(kind.check, src_cfg, spec, src_tensors, layout.read(tmp), storage, target_model,
                              where, q8_0)
        facts = CardFacts(
            fmt=fmt,
            kind=kind.name,
            target_name=spec.name_or_path,
            location=push_to_hub or str(out.resolve()),
            num_speculative_tokens=num_speculative_tokens,
            license=license,
            draft_p_min=p_min,
            eval_report=report,
            picture=PICTURE if picture and picture.exists() else None,
            data=run.get("data"),
            training={k: run[k] for k in ("head", "optim") if k in run},
            speculative_keys=kind.speculative_keys(fmt),
            **kind.card_facts(src_cfg, fmt),
        )
        if facts.picture:
            shutil.copyfile(picture, tmp / PICTURE)
        card = render(facts, kind.title, kind.formats[fmt].library, kind.serve_lines(facts))
        (tmp / "README.md").write_text(card)
    result = {"format": fmt, "out": str(out), **check}
    if push_to_hub:
        from heads.export.hub import push_folder

        result["pushed"] = push_folder(out, push_to_hub)
    return out, result


def detect_format(folder: str | Path) -> str:
    """Which export format a folder holds, from its config.json."""
    folder = Path(folder)
    cfg = read_json(folder / "config.json", "export")
    layouts = kinds.layouts()
    found = next((fmt for fmt, layout in layouts.items() if layout.matches(cfg)), None)
    if found is None:
        raise UserError(f"{folder}: config.json is none of the formats {', '.join(layouts)}")
    return found


def load_export(folder: str | Path, target_model, target_name: str) -> torch.nn.Module:
    """An exported folder back as a draftsmith head module (our own loader for its format), e.g.
    to evaluate exactly what an engine will serve."""
    fmt = detect_format(folder)
    kind = kinds.format_kind(fmt)
    cfg, tensors = kind.formats[fmt].read(Path(folder))
    spec = TargetSpec.from_model(target_model, target_name)
    return kind.check.build(cfg, spec, tensors, target_model)
