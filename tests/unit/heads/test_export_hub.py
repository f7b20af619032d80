"""push_to_hub through the real huggingface_hub client.

Only the network is faked: huggingface_hub's HTTP client gets a mock transport (its documented
`set_client_factory` hook) that answers like the Hub. Everything above it (repo creation, YAML
validation, pre-upload negotiation, the commit payload) is the library's real code.
"""

from __future__ import annotations

import base64
import gzip
import json

import httpx2
import huggingface_hub
import pytest
import torch

from conf.kinds import Eagle3Config
from heads.eagle3.model import Eagle3Head
from heads.export.write import export_head

FAKE_TOKEN = "hf_draftsmithTestToken0123"


class FakeHub:
    """Answers the endpoints an upload uses; records what was sent."""

    def __init__(self, authorised: bool = True):
        self.authorised, self.requests, self.files, self.yaml = authorised, [], {}, None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        path = request.url.path
        if path.endswith("/api/repos/create"):
            if request.headers.get("authorization") != f"Bearer {FAKE_TOKEN}":
                return httpx2.Response(401, json={"error": "Invalid credentials"})
            return httpx2.Response(200, json={"url": "https://huggingface.co/me/smol-eagle3"})
        if path.endswith("/api/validate-yaml"):
            self.yaml = json.loads(request.content)["content"]
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if "/preupload/" in path:
            files = json.loads(request.content)["files"]
            modes = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
            ]
            return httpx2.Response(200, json={"files": modes})
        if "/commit/" in path:
            body = request.content
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    value = item["value"]
                    self.files[value["path"]] = base64.b64decode(value["content"])
            url = "https://huggingface.co/me/smol-eagle3/commit/0123abc"
            return httpx2.Response(200, json={"commitUrl": url, "commitOid": "0123abc"})
        return httpx2.Response(404, json={"error": "not found"})


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    def install(hub: FakeHub, token: str | None):
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        else:
            monkeypatch.delenv("HF_TOKEN", raising=False)
        huggingface_hub.set_client_factory(
            lambda: httpx2.Client(transport=httpx2.MockTransport(hub))
        )
        huggingface_hub.close_session()
        return hub

    yield install
    huggingface_hub.set_client_factory(httpx2.Client)
    huggingface_hub.close_session()


@pytest.fixture(scope="module")
def head_dir(tiny_model, tmp_path_factory):
    model = tiny_model
    v = model.config.vocab_size
    d2t, t2d = torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    # Named after the alias so the card's base_model is a Hub id (vocab/hidden come from the
    # tiny model; only the name is borrowed).
    head = Eagle3Head.from_target(
        model, "smollm2-135m-instruct", Eagle3Config(), d2t, t2d
    )
    return head.save_pretrained(tmp_path_factory.mktemp("hub") / "head")


def test_push_uploads_every_file_and_never_prints_the_token(head_dir, tmp_path, fake_hub, capfd):
    hub = fake_hub(FakeHub(), FAKE_TOKEN)
    out, result = export_head(
        head_dir, "speculators", tmp_path / "out", push_to_hub="me/smol-eagle3"
    )
    assert result["pushed"] == "https://huggingface.co/me/smol-eagle3/commit/0123abc"
    assert set(hub.files) == {"README.md", "config.json", "model.safetensors"}
    for name, content in hub.files.items():
        assert content == (out / name).read_bytes(), name
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in hub.yaml
    # The card points users at the repo, not at this machine's folder.
    assert "vllm serve me/smol-eagle3" in hub.files["README.md"].decode()
    printed = capfd.readouterr()
    assert FAKE_TOKEN not in printed.out + printed.err


def unreachable(request: httpx2.Request) -> httpx2.Response:
    raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution", request=request)


@pytest.mark.parametrize(
    "make_hub,token,reason",
    [
        (FakeHub, None, "no Hugging Face token; set HF_TOKEN"),
        (lambda: unreachable, FAKE_TOKEN, "cannot reach the Hub ([Errno -3] Temporary failure"),
    ],
    ids=["no-token", "no-network"],
)
def test_cli_push_failure_is_one_line_and_keeps_the_export(
    head_dir, tmp_path, fake_hub, capsys, make_hub, token, reason
):
    from heads.export.__main__ import main

    hub = fake_hub(make_hub(), token)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main([f"head={head_dir}", "format=eagle3", f"out={out}", "push_to_hub=me/smol-eagle3"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: push_to_hub=me/smol-eagle3: {reason}"), err
    assert err.count("\n") == 1 and f"the export in {out} is kept" in err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".out.tmp-*"))
    if token is None:
        assert hub.requests == []  # refused without a round trip to the Hub


def test_the_main_job_pushes_its_export_and_refuses_two_formats_before_work(
    sharp_target, chat_file, tmp_path, fake_hub
):
    """`export.push_to_hub` in the main job does what `heads.export push_to_hub=` does; with more
    than one format (one repo holds one) it is refused before anything runs."""
    from pathlib import Path

    from tests.support.runs import tiny_run_config, user_error_line
    from trainer.train import run

    hub = fake_hub(FakeHub(), FAKE_TOKEN)
    push = ("pipeline.export=true", "export.push_to_hub=me/smol-eagle3", "optim.max_steps=2")
    both = tiny_run_config("eagle3", sharp_target, chat_file, tmp_path / "both", *push)
    line = user_error_line(lambda: run(both))
    assert line.startswith("error: export.push_to_hub=me/smol-eagle3: one repo holds one format; add export.")
    assert not (tmp_path / "both").exists() and hub.requests == []

    speculators = "export.formats=[speculators]"
    one = tiny_run_config("eagle3", sharp_target, chat_file, tmp_path / "one", *push, speculators)
    (out,) = run(one)["exports"]
    assert set(hub.files) == {"README.md", "config.json", "model.safetensors"}
    assert hub.files["config.json"] == (Path(out) / "config.json").read_bytes()
    assert out == str(tmp_path / "one" / "export" / "speculators")
