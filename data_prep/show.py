"""`python -m data_prep.show <data folder or run_dir> [index=N] [format=text|json]`: one sample's
rows with the supervised tokens marked, so a new chat template is checked in seconds rather than
after a training run (a wrong mask raises no error, it only trains a worse head).

A sample is one source conversation (one regenerated answer of it, with `num_samples` > 1): all
the rows that share its uid (`sources.prompt_uid`; a template that rewrites history gives one
row per turn). `index=N` is the N-th sample in the folder's order (train split, then validation).
`text` prints each row decoded, the supervised runs in colour on a terminal and in `[[...]]`
otherwise; `json` prints one object per row: `{"uid", "text", "supervised": [each maximal run of
supervised tokens, decoded]}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

from conf.compose import print_help, split_args
from conf.errors import UserError, exit_on_user_error, no_such_key
from conf.schema import RootConfig, TargetConfig
from conf.usage import wants_help
from data_prep.conversations.sources import ANSWER_SEP, ROW_SEP
from data_prep.folders.store import MANIFEST, load_manifest, shard_uids
from data_prep.target import resolve_target

FORMATS = ("text", "json")
USAGE = "python -m data_prep.show <data folder or run_dir> [index=N] [format=text|json]"
OWN_HELP = (
    ("<data folder or run_dir>", "", "a folder data_prep.prepare wrote, or a run_dir that names one"),
    ("index", "0", "the N-th sample, in the folder's order (train split, then validation)"),
    ("format", "text", "text: each row decoded, the supervised tokens marked | json: one object per row"),
)


def data_folder(path: str) -> Path:
    """A data folder, or the one a finished run's `summary.json` names."""
    p = Path(path).expanduser()
    if (p / MANIFEST).exists():
        return p
    summary = p / "summary.json"
    if summary.exists():
        return Path(json.loads(summary.read_text())["data_dir"])
    raise UserError(f"{path!r}: neither a data folder (no {MANIFEST}) nor a run_dir (no summary.json)")


def sample_of(uid: str) -> str:
    """The sample a row belongs to: its uid without the row number."""
    return uid.split(ROW_SEP, 1)[0]


def rows_of_sample(folder: Path, manifest: dict, index: int) -> list[tuple[str, list[int], list[bool]]]:
    """(uid, ids, mask) of every row of the index-th sample, in row order."""
    order: list[str] = []
    where: dict[str, list[tuple[str, Path, int]]] = {}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = folder / shard["file"]
            for i, uid in enumerate(shard_uids(path)):
                key = sample_of(uid)
                if key not in where:
                    order.append(key)
                    where[key] = []
                where[key].append((uid, path, i))
    if not order:
        raise UserError(f"{folder}: its shards name no uids (built before they were recorded); rebuild it")
    if not 0 <= index < len(order):
        raise UserError(
            f"index={index}: expected 0..{len(order) - 1} ({len(order)} samples in {folder})"
        )
    rows = []
    for uid, path, i in sorted(where[order[index]], key=lambda w: _row_number(w[0])):
        with safe_open(str(path), "pt") as f:
            a, b = f.get_tensor("offsets")[i : i + 2].tolist()
            ids = f.get_slice("input_ids")[a:b].tolist()
            mask = f.get_slice("loss_mask")[a:b].bool().tolist()
        rows.append((uid, ids, mask))
    return rows


def _row_number(uid: str) -> int:
    _, _, r = uid.partition(ROW_SEP)
    return int(r or 0)


def runs(ids: list[int], mask: list[bool]) -> list[tuple[bool, list[int]]]:
    """Maximal runs of equally masked tokens: (supervised, ids)."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def render_row(tok, uid: str, ids: list[int], mask: list[bool], fmt: str, colour: bool) -> str:
    parts = [(m, tok.decode(r)) for m, r in runs(ids, mask)]
    if fmt == "json":
        supervised = [text for m, text in parts if m]
        return json.dumps({"uid": uid, "text": tok.decode(ids), "supervised": supervised}, ensure_ascii=False)
    opened, closed = ("\033[1;32m", "\033[0m") if colour else ("[[", "]]")
    body = "".join(f"{opened}{text}{closed}" if m else text for m, text in parts)
    return f"--- row {uid}: {len(ids)} tokens, {sum(mask)} supervised\n{body}"


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help(USAGE, __doc__.split("\n\n")[0], shows=(), own=OWN_HELP)
        return
    paths = [a for a in argv if "=" not in a]
    own, rest = split_args([a for a in argv if "=" in a], ("index", "format"))
    if rest:
        raise no_such_key(rest[0].partition("=")[0], ("index", "format"))
    if len(paths) != 1:
        raise UserError(f"usage: {USAGE}")
    fmt = own.get("format", "text")
    if fmt not in FORMATS:
        raise UserError(f"format={fmt}: expected one of {', '.join(FORMATS)}")
    try:
        index = int(own.get("index", "0"))
    except ValueError:
        raise UserError(f"index={own['index']}: expected an integer") from None
    folder = data_folder(paths[0])
    manifest = load_manifest(folder)
    rows = rows_of_sample(folder, manifest, index)
    # The target the folder was built with, as its manifest names it (not the current config's).
    built = manifest["target"]
    named = TargetConfig(name_or_path=built["name_or_path"], revision=built.get("revision"))
    tok = resolve_target(RootConfig(target=named)).tokenizer
    colour = fmt == "text" and sys.stdout.isatty()
    if fmt == "text":
        print(f"sample {index} ({sample_of(rows[0][0]).split(ANSWER_SEP)[0]} in the source), {folder}")
    for uid, ids, mask in rows:
        print(render_row(tok, uid, ids, mask, fmt, colour))


if __name__ == "__main__":
    main()
