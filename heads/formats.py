"""Heads from elsewhere: a head folder of any format draftsmith reads, in draftsmith's own terms.

Evaluation (`python -m trainer.evaluate head=<folder>`) and training (`head.init_from=<folder>`)
take draftsmith's own head folder (`heads.folder`) or an engine's: the export formats of every
kind (`heads.kinds`), as draftsmith writes them or as another tool did (a speculators or native
EAGLE-3 folder from the Hub, a Medusa head for vLLM or TGI). One reader serves both, so they take
the same folders and refuse the same mismatches in the same words.

Reading goes through each format's own strict reader (`Layout.read`, the one exports are checked
with). A folder written elsewhere may leave out keys our exports always write; its format's
`Layout.defaults` first fills in what the engine assumes for them (vLLM's defaults for EAGLE-3),
so what is evaluated or trained from is what the engine would serve. What the folder says of its
target (vocabulary, hidden size, aux layers; draftsmith's own folders record a fingerprint) is
checked against the target at hand, and a mismatch is one line naming the folder and the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from conf.compose import compose_root
from conf.errors import UserError, first_line
from conf.files import read_json
from conf.schema import RootConfig
from heads.export.core import Tensors, read_folder
from heads.export.write import detect_format
from heads.folder import (
    CONFIG_NAME,
    TargetSpec,
    compose_for_head,
    load_head,
    nonfinite_tensors,
    read_head_meta,
)
from heads.kinds import HeadKind, format_kind, saved_head_kind
from heads.parts import resolve_aux_layer_ids

DRAFTSMITH = "draftsmith"  # the format name of draftsmith's own head folder
EMBED = "embed_tokens.weight"  # speculators saves the verifier's input embeddings with a head
# Not compared by `head.init_from`: the run's draft layer takes the target's (vLLM raises a head's
# to the target's too), and it sizes no weight.
NOT_COMPARED = ("max_position_embeddings",)


@dataclass(frozen=True)
class ReadHead:
    """A head folder read into draftsmith's terms, checked against a target."""

    where: str  # how messages name it: head=<folder> or head.init_from=<folder>
    fmt: str  # DRAFTSMITH, or the export format its config.json holds
    kind: HeadKind
    config: dict  # the head config, as draftsmith's own folder saves it
    tensors: Tensors  # in draftsmith's names, the target's embeddings left out
    target: TargetSpec  # the folder's recorded fingerprint, else the target it was checked against
    embed: torch.Tensor | None = None  # input embeddings the folder carries itself (`check_embeddings`)


def folder_format(path: str | Path, key: str = "head") -> str:
    """DRAFTSMITH for draftsmith's own head folder, else the export format of its config.json;
    one line naming the folder when it is neither."""
    folder, where = Path(path), f"{key}={str(path)!r}"
    if (folder / CONFIG_NAME).exists():
        return DRAFTSMITH
    if not folder.is_dir():
        raise UserError(f"{where}: no such folder")
    if not (folder / "config.json").exists():
        raise UserError(
            f"{where}: neither {CONFIG_NAME} (a draftsmith head folder) nor config.json (an engine's) there"
        )
    return detect_format(folder)


def folder_kind(path: str | Path) -> HeadKind:
    """The kind of the head in a folder of any format."""
    fmt = folder_format(path)
    return saved_head_kind(path) if fmt == DRAFTSMITH else format_kind(fmt)


def _object(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def named_target(path: str | Path) -> str | None:
    """The target a head folder names: draftsmith's fingerprint, a speculators config's verifier,
    a TGI Medusa config's base model; None where the format records none (a native EAGLE-3
    folder, vLLM's Medusa)."""
    if folder_format(path) == DRAFTSMITH:
        return read_head_meta(path)["target"]["name_or_path"]
    top = read_json(Path(path) / "config.json", f"head={str(path)!r}")
    verifier = _object(_object(top.get("speculators_config")).get("verifier"))
    name = verifier.get("name_or_path") or top.get("base_model_name_or_path")
    return str(name) if name else None


def _finite(tensors: Tensors, where: str) -> Tensors:
    """`tensors`, or one line where one holds a NaN or an infinity (a diverged run's head is never
    evaluated or trained from, whoever wrote it)."""
    bad = nonfinite_tensors(tensors.items())
    if bad:
        raise UserError(f"{where}: holds non-finite weights ({len(bad)} tensor(s), first {bad[0]})")
    return tensors


def _read_export(
    folder: Path, fmt: str, text_config, where: str
) -> tuple[HeadKind, dict, Tensors, torch.Tensor | None]:
    """(kind, config, tensors, own input embeddings) of an engine's folder, through its format's
    strict reader; a config.json whose values are not of the shapes the format has is one line."""
    kind = format_kind(fmt)
    layout = kind.formats[fmt]
    embed = None
    try:
        if layout.defaults is None:
            config, tensors = layout.read(folder)
        else:
            top, tensors = read_folder(folder, layout.weights_file)
            embed = tensors.pop(EMBED, None)
            config, tensors = layout.read(folder, loaded=layout.defaults(top, tensors, text_config, where))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(
            f"{where}: not a {fmt} folder an engine loads ({type(err).__name__}: {err})"
        ) from None
    return kind, config, _finite(tensors, where), embed


def check_target(
    where: str, config: dict, recorded: TargetSpec | None, target_config, target_name: str
) -> TargetSpec:
    """Refuse, in one line naming the field, a head made for another target than the one whose
    config is `target_config`; return the fingerprint the head is used with. Draftsmith's folders
    record one; other formats are held to the sizes their config states (vocabulary, hidden size,
    the target's hidden size) and to aux layers this target has."""
    t = target_config.get_text_config()
    actual = TargetSpec(target_name, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    if recorded is not None:
        recorded.check(actual, where)
    wants = {"vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "target_hidden_size": t.hidden_size}
    diffs = [f"{k} {config[k]} != {v}" for k, v in wants.items() if k in config and config[k] != v]
    if diffs:
        raise UserError(f"{where}: a head for another target than {target_name!r}: {'; '.join(diffs)}")
    if "aux_layer_ids" in config:
        resolve_aux_layer_ids(config["aux_layer_ids"], t.num_hidden_layers, f"{where}: aux_layer_ids", None)
    return recorded or actual


def read_any_head(path: str | Path, target_config, target_name: str, key: str = "head") -> ReadHead:
    """The head in a folder of any format draftsmith reads, checked against the target whose
    config is `target_config` (`check_target`); or one line naming the folder and what is wrong
    (missing, cut off, damaged, not finite, malformed, made for another target). `key`: the
    setting that named the folder, for the messages."""
    where = f"{key}={str(path)!r}"
    fmt = folder_format(path, key)
    embed = recorded = None
    if fmt == DRAFTSMITH:
        kind = saved_head_kind(path)
        config, recorded, tensors = load_head(path, kind.name)
    else:
        kind, config, tensors, embed = _read_export(Path(path), fmt, target_config.get_text_config(), where)
    spec = check_target(where, config, recorded, target_config, target_name)
    return ReadHead(where, fmt, kind, config, tensors, spec, embed)


def check_embeddings(read: ReadHead, target_model) -> None:
    """A folder's own input embeddings must be the target's (in the folder's dtype): draftsmith's
    heads use the target's, and vLLM serves a head with its own only where they differ, so such a
    head would be measured or trained as something else than it is served."""
    if read.embed is None:
        return
    own = target_model.get_input_embeddings().weight.detach()
    embed = read.embed
    if embed.shape != own.shape or not torch.equal(embed, own.to(embed.device, embed.dtype)):
        raise UserError(
            f"{read.where}: its {EMBED} is not the target's input embeddings: vLLM would draft with "
            "the folder's own, which a draftsmith head does not hold"
        )


def load_for_decoding(path: str | Path, target_model, target_name: str) -> tuple[HeadKind, nn.Module, object]:
    """(kind, head module, the model that verifies its drafts) for a folder of any format.

    Draftsmith's own folders load through their kind's loader (a Medusa-2 head verifies with its
    own target); any other is built by its kind's export check (`KindOps.build`, what exports are
    proved with) from what its strict reader read, after the target checks, and verifies with
    `target_model`."""
    if folder_format(path) == DRAFTSMITH:
        kind = saved_head_kind(path)
        head, verifier = kind.load_for_decoding(path, target_model, target_name)
        return kind, head, verifier
    read = read_any_head(path, target_model.config, target_name)
    check_embeddings(read, target_model)
    head = read.kind.check.build(read.config, read.target, read.tensors, target_model)
    return read.kind, head, target_model


def compose_for_any_head(head_path: str, overrides: list[str]) -> RootConfig:
    """`heads.folder.compose_for_head` for a folder of any format. Draftsmith's own folder gives its
    kind, target and chat template settings; an engine's gives its kind and the target its config
    names (`named_target`), or needs `target.name_or_path=` where it names none. Its files are
    checked first (readable, finite), so a broken folder is one line before any target loads; the
    rest, which needs the target's config, when it is read for use (`read_any_head`)."""
    if not head_path:
        raise UserError("head=<path> is required (a head folder: draftsmith's own, or an engine's export)")
    fmt = folder_format(head_path)
    if fmt == DRAFTSMITH:
        return compose_for_head(head_path, overrides)
    kind = format_kind(fmt)
    _finite(read_folder(Path(head_path), kind.formats[fmt].weights_file)[1], f"head={head_path!r}")
    extra = [f"+head={kind.name}"]
    if not any(o.startswith("target.name_or_path=") for o in overrides):
        name = named_target(head_path)
        if name is None:
            raise UserError(
                f"head={head_path!r}: a {fmt!r} folder does not name its target: add "
                "target.name_or_path=<the model it drafts for>"
            )
        extra.append(f"target.name_or_path={name}")
    return compose_root(extra + overrides)


def load_target_config(cfg: RootConfig):
    """The config of `target.*` as transformers reads it, for a command of this layer that reads
    an engine's folder without a run (`python -m heads.export`). A Hugging Face folder or a Hub
    id: an alias or a GGUF file is converted by data prep, a layer above, so it is one line
    asking for the folder or Hub id (the converted folder serves)."""
    from transformers import AutoConfig

    t = cfg.target
    try:
        return AutoConfig.from_pretrained(t.name_or_path, revision=t.revision,
                                          trust_remote_code=t.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(
            f"target.name_or_path={t.name_or_path!r}: cannot load a model config ({first_line(err)}); "
            "an engine's folder is read against its target's config: give a Hugging Face folder or Hub id"
        ) from None


def save_as_own(read: ReadHead, out: str | Path) -> Path:
    """`read` written as draftsmith's own head folder at `out`, through its kind's export check
    (`KindOps.build`, what exports are proved with) and the head's own `save_pretrained`, so every
    command that takes a run's head (`python -m heads.export`) takes an engine's folder too. Input
    embeddings a folder carries itself are left out, as from every draftsmith head (the target's)."""
    return read.kind.check.build(read.config, read.target, read.tensors, None).save_pretrained(out)


# ---- head.init_from --------------------------------------------------------------------------


def _mismatch(read: ReadHead, cfg: RootConfig, field: str, theirs: object, ours: object) -> UserError:
    """One line naming a field where the head differs from this run, and the override that takes
    the head's value where the field is a head setting."""
    settable = field in {f.name for f in dataclasses.fields(cfg.head)}
    value = json.dumps(theirs, separators=(",", ":"))
    hint = f"add head.{field}={value}" if settable else "start from a head of this run's shape"
    return UserError(f"{read.where}: its {field} {theirs} != this run's {ours}: {hint}")


def read_init_head(cfg: RootConfig, target_config) -> ReadHead:
    """`head.init_from`'s folder, read and checked against this run: its kind, its target and the
    aux layers capture reads (checked before any data stage). A Medusa-2 head is refused: its
    heads fit the target it was trained with, which a run does not start from."""
    read = read_any_head(cfg.head.init_from, target_config, cfg.target.name_or_path, "head.init_from")
    if read.kind.name != cfg.head.name:
        raise UserError(
            f"{read.where}: a {read.kind.name!r} head, and this run trains {cfg.head.name!r}: "
            f"use +head={read.kind.name} to continue it"
        )
    if read.config.get("target_update"):
        raise UserError(
            f"{read.where}: trained jointly with its target (target_update={read.config['target_update']}); "
            "its heads fit that target alone: start from a Medusa-1 head"
        )
    layers = target_config.get_text_config().num_hidden_layers
    ours = list(read.kind.captured_layers(cfg.head, layers)[0])
    theirs = read.config.get("aux_layer_ids")
    if theirs is not None and sorted(theirs) != ours:
        raise _mismatch(read, cfg, "aux_layer_ids", sorted(theirs), ours)
    return read


def _config_dict(head: nn.Module) -> dict:
    config = head.config
    return config if isinstance(config, dict) else config.to_dict()


def init_trainee_head(cfg: RootConfig, head: nn.Module, target_model) -> None:
    """Start `head`, a fresh trainee's, from `head.init_from`'s weights (two-stage fine-tuning).

    The head must be this run's: every field its kind's export check compares (sizes, aux layers,
    norm flags, vocabularies) equal to the fresh head's, else one line naming the field and the
    override that takes the folder's value; its embeddings, where it holds them, the target's.
    Every trainable tensor of the fresh head is replaced; the frozen ones a head shares with its
    target (embeddings) stay the target's."""
    read = read_init_head(cfg, target_model.config)
    check_embeddings(read, target_model)
    check_fits(read, cfg, head)
    head.load_state_dict(read.tensors, strict=False)


def check_fits(read: ReadHead, cfg: RootConfig, head: nn.Module) -> None:
    """Refuse `read` (`head.init_from`'s) where it cannot load into `head`, this run's fresh head
    (built on the meta device, it serves before any data stage: `trainer.kinds.check_init_from`):
    a field its kind's export check compares (sizes, aux layers, norm flags, vocabularies), one
    line naming it and the override that takes the folder's value; else a tensor this head has
    not, lacks or holds in another shape (settings that change tensors without a field)."""
    fields_of = read.kind.check.config_fields
    ours, theirs = fields_of(_config_dict(head)), fields_of(read.config)
    for field, value in ours.items():
        if field not in NOT_COMPARED and theirs.get(field) != value:
            raise _mismatch(read, cfg, field, theirs.get(field), value)
    state = head.state_dict()
    unknown = sorted(set(read.tensors) - set(state))
    lacking = sorted(k for k, p in head.named_parameters() if p.requires_grad and k not in read.tensors)
    wrong = sorted(k for k, v in read.tensors.items() if k in state and v.shape != state[k].shape)
    if unknown or lacking or wrong:
        raise UserError(
            f"{read.where}: not this run's head: unknown tensors {unknown}, missing {lacking}, shapes {wrong}"
        )
