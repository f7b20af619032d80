"""Reading and normalising conversation sources: shapes, roles, bad rows, the packaged ShareGPT."""

from __future__ import annotations

import json

import pytest

from conf.errors import UserError
from conf.schema import DataConfig, RegenerateConfig
from data_prep.conversations.sources import (
    iter_json_array,
    iter_samples,
    normalise_row,
    shape_conversation,
    sharegpt_file,
    sharegpt_jsonl,
    split_hash,
)
from data_prep.stats import PrepStats
from tests.support.split import validation_uids


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def cfg_for(source: str, regenerate: bool = False, **kw) -> DataConfig:
    return DataConfig(source=source, regenerate=RegenerateConfig(enabled=regenerate), **kw)


SHAREGPT_ROW = {
    "id": "a",
    "conversations": [
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
    ],
}
OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}


def test_shapes_normalise_to_role_content():
    assert normalise_row(SHAREGPT_ROW, "f:1") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert normalise_row(OPENAI_ROW, "f:1")[0] == {"role": "system", "content": "be brief"}
    assert normalise_row({"prompt": "q"}, "f:1") == [{"role": "user", "content": "q"}]
    assert normalise_row({"prompt": "q", "response": "a"}, "f:1")[1]["role"] == "assistant"


@pytest.mark.parametrize(
    "row, expected",
    [
        ('{"conversations": [', "f.jsonl:2: malformed JSON"),
        ({"text": "x"}, "f.jsonl:2: row has none of the fields conversations"),
        ({"conversations": []}, "f.jsonl:2: field conversations: empty conversation"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
            "f.jsonl:2: field messages[1].role: unknown role 'robot'",
        ),
        (
            {"conversations": [{"from": "human", "value": 3}]},
            "f.jsonl:2: field conversations[0].value: expected a string",
        ),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "f.jsonl", [SHAREGPT_ROW, row])
    with pytest.raises(UserError) as err:
        list(iter_samples(cfg_for(path), PrepStats()))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(str(tmp_path / expected.split(":")[0])) and expected.split(":", 1)[1] in msg


def test_no_assistant_turn_is_skipped_and_counted(tmp_path):
    rows = [
        SHAREGPT_ROW,
        {"prompt": "only a question"},
        {
            "conversations": [
                {"from": "gpt", "value": "an answer to nothing"},
                {"from": "human", "value": "q"},
            ]
        },
    ]
    path = write_jsonl(tmp_path / "f.jsonl", rows)
    stats = PrepStats()
    samples = list(iter_samples(cfg_for(path), stats))
    assert [s.uid for s in samples] == ["1"]
    assert stats == PrepStats(rows=3, skipped_no_assistant=2)
    # With regeneration the prompts are all that matter: every row with a user turn is usable.
    stats = PrepStats()
    samples = list(iter_samples(cfg_for(path, regenerate=True), stats))
    assert [s.uid for s in samples] == ["1", "2", "3"]
    assert all(m["role"] != "assistant" for s in samples for m in s.messages)


def test_shape_conversation_turns_and_system():
    u = [{"role": "user", "content": f"u{i}"} for i in range(3)]
    a = [{"role": "assistant", "content": f"a{i}"} for i in range(3)]
    sys_msg = {"role": "system", "content": "s"}
    conv = [sys_msg, a[0], u[0], a[1], u[1], a[2], u[2]]
    assert shape_conversation(conv, 0, False) == [sys_msg, u[0], a[1], u[1], a[2]]
    assert shape_conversation(conv, 1, False) == [sys_msg, u[0], a[1]]
    assert shape_conversation(conv, 2, True) == [sys_msg, u[0], u[1]]


def test_datasets_source_saved_to_disk(tmp_path):
    import datasets

    datasets.Dataset.from_list([OPENAI_ROW, OPENAI_ROW]).save_to_disk(str(tmp_path / "ds"))
    samples = list(iter_samples(cfg_for(str(tmp_path / "ds")), PrepStats()))
    assert [s.uid for s in samples] == ["0", "1"]
    assert samples[0].messages[-1] == {"role": "assistant", "content": "4"}


def test_json_array_file(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([SHAREGPT_ROW, OPENAI_ROW]))
    assert [s.uid for s in iter_samples(cfg_for(str(path)), PrepStats())] == ["0", "1"]
    path.write_text('[\n{"conversations": [}\n]')
    with pytest.raises(UserError, match=r"chats.json:2: malformed JSON"):
        list(iter_samples(cfg_for(str(path)), PrepStats()))
    path.write_text(json.dumps([SHAREGPT_ROW, {"messages": [{"role": "user"}]}]))
    with pytest.raises(UserError, match=r"chats.json: element 1: field messages\[0\].content"):
        list(iter_samples(cfg_for(str(path)), PrepStats()))


def test_non_utf8_sources_name_file_and_line(tmp_path):
    good = json.dumps(SHAREGPT_ROW).encode()
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_bytes(good + b"\n" + good + b"\n" + good.replace(b"hello", b"h\xe9llo") + b"\n")
    with pytest.raises(UserError, match=r"chats.jsonl:3: not UTF-8 text"):
        list(iter_samples(cfg_for(str(jsonl)), PrepStats()))
    array = tmp_path / "chats.json"
    array.write_bytes(b"[\n" + good + b",\n" + good.replace(b"hello", b"h\xe9llo") + b"\n]")
    with pytest.raises(UserError, match=r"chats.json:3: not UTF-8 text"):
        list(iter_samples(cfg_for(str(array)), PrepStats()))


def test_missing_jsonl_and_bad_dataset_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="data.source=.*no such file"):
        list(iter_samples(cfg_for(str(tmp_path / "nope.jsonl")), PrepStats()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="data.source="):
        list(iter_samples(cfg_for(str(tmp_path / "empty")), PrepStats()))


def test_json_array_recovers_complete_elements_of_a_truncated_file():
    assert list(iter_json_array('[{"a": 1}, {"b": [2]},\n {"c": "tru')) == [{"a": 1}, {"b": [2]}]
    assert list(iter_json_array("[]")) == []


def test_packaged_sharegpt_converts_once_to_jsonl():
    text = sharegpt_file().read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    rows = list(iter_json_array(text))
    assert len(rows) == 17671
    nonempty = sum(1 for r in rows if r["conversations"])
    path = sharegpt_jsonl()
    assert sharegpt_jsonl() == path
    with open(path, encoding="utf-8") as fh:
        assert sum(1 for _ in fh) == nonempty


def test_split_is_a_seeded_hash_stable_under_growth():
    uids = [str(i) for i in range(400)]
    val = validation_uids(uids, 0, 0.1)
    assert 20 < len(val) < 60
    assert validation_uids(uids[:200], 0, 0.1) == {u for u in val if int(u) < 200}
    assert validation_uids(uids, 1, 0.1) != val
    assert split_hash("7", 0) == split_hash("7", 0)
    # A tiny set still gets one validation sample; a zero fraction gets none.
    assert len(validation_uids(["a", "b"], 0, 0.01)) == 1
    assert validation_uids(uids, 0, 0.0) == set()
