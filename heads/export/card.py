"""The README.md written next to every export: Hub metadata, measured acceptance, how to serve.

Pure text assembly from plain dicts, so tests check it without a model; `export_head` gathers the
facts (eval.json, the run's config, the aux-layer ids per engine) and passes them in, with what
differs by kind from its record (title, library, serve commands): the kinds' export modules import
`CardFacts` to write their serve commands, so this module imports no kind or record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from heads.parts import NORM_FLAGS

# Aliases of the project's embedded targets -> their Hub ids (for base_model and serve commands).
HUB_IDS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
}

# The evaluation's per-position acceptance picture: beside eval.md, which shows it, and copied
# beside every card that shows the same evaluation's table.
PICTURE = "acceptance.png"

# Data sources of data_prep -> Hub dataset ids, for the `datasets` metadata.
DATASET_IDS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}


def hub_id(target_name: str) -> str | None:
    """The target's Hub id, or None for a local folder/file (base_model must be a Hub id)."""
    if target_name in HUB_IDS:
        return HUB_IDS[target_name]
    looks_like_id = target_name.count("/") == 1 and not target_name.startswith((".", "/", "~"))
    return target_name if looks_like_id and not Path(target_name).exists() else None


@dataclass
class CardFacts:
    fmt: str  # export format name
    kind: str  # the head kind's name (a tag on the card)
    target_name: str
    location: str  # where users fetch the head from: a Hub repo id or the exported folder
    num_speculative_tokens: int
    license: str
    # llama.cpp's --spec-draft-p-min: the evaluator's best (`served_setting`), else what it decoded
    # with (llama.cpp's own default, 0.75, is not what was measured, so the line always says it).
    draft_p_min: float = 0.0
    layer_ids: dict[str, list[int]] = field(default_factory=dict)  # engine -> aux ids (eagle3)
    eval_report: dict | None = None  # eval.json
    picture: str | None = None  # the evaluation's acceptance.png, copied beside the card
    data: dict | None = None  # the run's `data` config
    training: dict | None = None  # the run's `head` and `optim` configs
    notes: list[str] = field(default_factory=list)
    # vLLM's speculative_config keys besides model and num_speculative_tokens (the kind's record)
    speculative_keys: dict = field(default_factory=dict)


def front_matter(f: CardFacts, library: str) -> str:
    base = hub_id(f.target_name)
    lines = ["---"]
    if base:
        lines.append(f"base_model: {base}")
    lines += [f"library_name: {library}", f"license: {f.license}", "tags:"]
    tags = ["speculative-decoding", f.kind, "draft-model", "draftsmith", f.fmt]
    lines += [f"- {t}" for t in dict.fromkeys(tags)]
    source = (f.data or {}).get("source")
    if source in DATASET_IDS:
        lines += ["datasets:", f"- {DATASET_IDS[source]}"]
    lines.append("---")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def acceptance_section(report: dict | None, picture: str | None = None) -> str:
    """The evaluation's table, how many prompts stand behind it, and its picture (`picture`: the
    file name of the evaluation's acceptance.png copied beside the card)."""
    if not report:
        return "## Measured acceptance\n\nNo eval.json was given at export time: not measured.\n"
    s = report.get("settings", {})
    how = (
        f"{s.get('mode', 'chain')} drafting"
        + (
            f" with {s['num_speculative_tokens']} speculative tokens"
            + (f" at p_min {s['draft_p_min']}" if s.get("draft_p_min") else "")
            if s.get("mode") == "chain"
            else ""
        )
        + f", temperature {s.get('temperature', 0.0)}, up to {s.get('max_new_tokens')} new tokens"
    )
    rows = list(report.get("tasks", {}).items()) + [("overall", report.get("overall", {}))]
    table = [
        "| task | prompts | mean acceptance length | acceptance per position | speedup vs greedy |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {name} | {m.get('prompts', '-')} | {_num(m.get('mean_acceptance_length'))} | "
        f"{', '.join(_num(r) for r in m.get('acceptance_per_position', []))} | "
        f"{_num(m.get('speedup_vs_greedy'))} |"
        for name, m in rows
    ]
    prompts = report.get("overall", {}).get("prompts")
    sample = f" on {prompts} prompts in all: read differences below ~0.05 as noise" if prompts else ""
    return "\n".join(
        [
            "## Measured acceptance",
            "",
            "Mean acceptance length = tokens per target forward, counting the bonus token (vLLM's "
            f"`1 + accepted / drafts`), measured by draftsmith's evaluator ({how}){sample}. Speedup "
            "is wall-clock on the machine that ran the evaluation.",
            "",
            *table,
            "",
            f"Greedy speculative output identical to plain greedy decoding: "
            f"{report.get('lossless')}.",
            *(["", f"![Per-position acceptance]({picture})"] if picture else []),
        ]
    )


def served_setting(report: dict | None) -> dict | None:
    """The evaluator's best chain setting (eval.json `draft_settings.best`: k, p_min, predicted τ
    and speedup; `trainer.evaluate.settings`), or None where it swept none or none paid."""
    return ((report or {}).get("draft_settings") or {}).get("best")


def setting_lines(report: dict | None) -> list[str]:
    """What the Serve section says first about the evaluator's sweep of k and p_min: the setting
    the commands carry, or, plainly, that no setting beat greedy decoding where it was measured."""
    sweep = (report or {}).get("draft_settings") or {}
    best, fastest = sweep.get("best"), sweep.get("fastest")
    if best:
        return [f"These commands carry the fastest chain setting draftsmith's evaluator found on the "
                f"machine that ran it: {best['k']} speculative tokens, p_min {best['p_min']} (predicted "
                f"mean acceptance length {_num(best['mean_acceptance_length'])}, "
                f"{_num(best['speedup_vs_greedy'])}x greedy decoding; eval.md holds every setting). "
                "llama.cpp stops drafting below p_min (`--spec-draft-p-min`); vLLM has no such "
                "threshold and drafts every token.", ""]
    if fastest:
        measured = (sweep.get("check") or {}).get("measured", {}).get("speedup_vs_greedy")
        speed = (f"predicted {_num(fastest['speedup_vs_greedy'])}x, {_num(measured)}x when decoded"
                 if fastest["speedup_vs_greedy"] >= 1.0 else f"{_num(fastest['speedup_vs_greedy'])}x")
        return [f"**No drafting setting was faster than plain greedy decoding** in draftsmith's "
                f"evaluator on the machine that ran it (the fastest, {fastest['k']} speculative "
                f"tokens at p_min {fastest['p_min']}: {speed}): on such a machine, serve the target "
                "alone. The commands below are for one where the head pays; measure there first "
                "(`python -m trainer.evaluate`).", ""]
    return []


def serve_section(lines: list[str], report: dict | None = None) -> str:
    return "\n".join(["## Serve", "", *setting_lines(report), *lines, ""])


# Engine -> (its numbering of the captured layers, where it reads the ids), in the card's order.
LAYER_ID_ROWS = {
    "vllm": ("draftsmith / vLLM (`hidden_states[k]` = residual stream after k layers)",
             "`eagle_aux_hidden_state_layer_ids`"),
    "sglang": ("SGLang (adds one before capturing)", "`eagle_config.eagle_aux_hidden_state_layer_ids`"),
    "trtllm": ("TensorRT-LLM (output of layer i)", "`eagle3_layers_to_capture` at serve time"),
    "llama.cpp": ("llama.cpp (input of layer k = draftsmith's `hidden_states[k]`)",
                  "`eagle3.target_layers` in the GGUF"),
}


def layer_ids_section(f: CardFacts) -> str:
    if not f.layer_ids:
        return ""
    rows = [
        f"| {convention} | {f.layer_ids[engine]} | {where} |"
        for engine, (convention, where) in LAYER_ID_ROWS.items()
        if engine in f.layer_ids
    ]
    return "\n".join(
        [
            "## Target layers the head reads",
            "",
            "The engines number the same three target features differently; this export writes "
            "each engine's numbering where that engine reads it:",
            "",
            "| convention | ids | where |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def data_section(data: dict | None) -> str:
    if not data:
        return "## Training data\n\nNot recorded next to the head.\n"
    regen = data.get("regenerate") or {}
    lines = [
        f"- source: `{data.get('source')}` (split `{data.get('split', 'train')}`), "
        f"at most {data.get('max_samples')} conversations, {data.get('max_length')} tokens each",
    ]
    if regen.get("enabled"):
        lines.append(
            "- assistant turns regenerated by the target itself (temperature "
            f"{regen.get('temperature')}, up to {regen.get('max_new_tokens')} new tokens), so "
            "the head learns the target's own distribution"
        )
    template, kwargs = data.get("chat_template"), data.get("chat_template_kwargs") or {}
    if template or kwargs:
        # Acceptance holds for prompts rendered as the head was trained and measured: say how.
        which = f"the chat template `{Path(template).name}`" if template else "the target's chat template"
        args = f" and `chat_template_kwargs` {json.dumps(kwargs, sort_keys=True)}" if kwargs else ""
        lines.append(
            f"- prompts rendered with {which}{args}; serve with the same (vLLM: `--chat-template`, "
            "`chat_template_kwargs` per request)"
        )
    return "\n".join(["## Training data", "", *lines, ""])


def training_section(training: dict | None) -> str:
    """The objective and schedule the head was trained with: acceptance depends on them as much
    as on the data, and a user reproducing or comparing heads needs them."""
    if not training:
        return ""
    head, optim = training.get("head") or {}, training.get("optim") or {}
    loss = head.get("loss", "ce")
    knobs = {"ce+tv": f", tv weight {head.get('tv_weight')}", "lk": f", eta {head.get('lk_eta')}"}
    prompt = head.get("prompt_loss_weight", 0.0)
    lines = [f"- loss `{loss}`{knobs.get(loss, '')}, prompt rows weighted {prompt}"]
    norms = [n for n in NORM_FLAGS if head.get(n)]
    if norms:
        lines.append("- EAGLE-3 norms on: " + ", ".join(f"`{n}`" for n in norms))
    if optim:
        lines.append(
            f"- {optim.get('epochs')} epochs, lr {optim.get('lr')}, {optim.get('batch_tokens')} tokens "
            f"per batch{' (packed)' if optim.get('packing') else ''}; the kept checkpoint is the best "
            f"by {optim.get('select_by', 'simulated')} acceptance length"
        )
    return "\n".join(["## Training", "", *lines, ""])


def render(f: CardFacts, title: str, library: str, serve: list[str]) -> str:
    """The card of an export (`f.kind` names its kind): its title, library and serve commands
    come from the kind's record (`heads.export.write` reads them)."""
    intro = (
        f"{title} for `{hub_id(f.target_name) or f.target_name}`, trained and exported "
        f"(format `{f.fmt}`) with draftsmith. It only speeds up that target: the verifier "
        "decides every token, so outputs are the target's own."
    )
    parts = [
        front_matter(f, library),
        f"# {title} for {hub_id(f.target_name) or f.target_name}",
        intro,
        acceptance_section(f.eval_report, f.picture),
        serve_section(serve, f.eval_report),
        layer_ids_section(f),
        data_section(f.data),
        training_section(f.training),
        "\n".join(f"- {n}" for n in f.notes),
    ]
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"
