"""The VRAM pane's model field: a config.json path, a folder, or a hub id fetched from a Hub (a local
HTTP server standing in for huggingface.co through HF_ENDPOINT), cached, and offline the bundled
config or a message naming the id and what to do."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from studio.core.model.info import ModelInfoError
from studio.core.model.source import bundled_config, cached_config, find_model

QWEN = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


class FakeHub(BaseHTTPRequestHandler):
    """Qwen/Qwen2.5-7B's config.json; HTTP 401 for anything under gated/ or meta-llama/; 404 else."""

    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        FakeHub.requests.append(self.path)
        if self.path == "/Qwen/Qwen2.5-7B/resolve/main/config.json":
            body, status = json.dumps(QWEN).encode(), 200
        elif self.path == "/broken/model/resolve/main/config.json":
            body, status = b"<html>not json</html>", 200
        elif self.path.startswith(("/gated/", "/meta-llama/")):
            body, status = b"gated", 401
        else:
            body, status = b"missing", 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(autouse=True)
def empty_caches(tmp_path, monkeypatch):
    """Studio's cache and the Hugging Face cache empty, the Hub unreachable unless a test serves one."""
    monkeypatch.setenv("STUDIO_CACHE", str(tmp_path / "studio-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeHub.requests = []
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield FakeHub.requests
    server.shutdown()
    server.server_close()


def test_a_hub_id_is_fetched_once_then_read_from_studios_cache(hub):
    source = find_model("Qwen/Qwen2.5-7B")
    assert source.where == "the Hub"
    assert (source.info.name, source.info.hidden, source.info.vocab) == ("Qwen/Qwen2.5-7B", 3584, 152064)
    assert hub == ["/Qwen/Qwen2.5-7B/resolve/main/config.json"]
    assert json.loads(cached_config("Qwen/Qwen2.5-7B").read_text()) == QWEN
    again = find_model("Qwen/Qwen2.5-7B")
    assert again.where == "the Hub's config.json (cached)" and again.info == source.info
    assert len(hub) == 1  # no second request


def test_offline_an_unknown_id_gets_one_line_naming_it_and_what_to_do():
    with pytest.raises(ModelInfoError) as caught:
        find_model("someone/some-model-7b")
    message = str(caught.value)
    assert message == ("could not reach the Hub for someone/some-model-7b (offline?): give a local folder "
                       "or a config.json path")


def test_offline_llama_2_7b_is_sized_from_the_bundled_config_and_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = find_model("meta-llama/Llama-2-7b-hf")
    assert source.where == "Studio's bundled config.json (the Hub could not be reached: offline?)"
    assert (source.info.hidden, source.info.intermediate, source.info.layers, source.info.vocab) == (
        4096, 11008, 32, 32000)
    assert bundled_config("meta-llama/Llama-2-7b-chat-hf") == bundled_config("meta-llama/Llama-2-7b-hf")


def test_a_gated_model_falls_back_to_the_bundled_config_and_otherwise_says_to_set_hf_token(hub):
    assert find_model("meta-llama/Llama-2-7b-hf").where == (
        "Studio's bundled config.json (the Hub refused it: HTTP 401, gated?)")
    with pytest.raises(ModelInfoError, match=r"the Hub refused gated/model \(HTTP 401: gated or private; "
                                             r"accept its licence on huggingface.co and set HF_TOKEN\)"):
        find_model("gated/model")


def test_an_id_the_hub_does_not_have_says_404_and_a_broken_answer_is_not_cached(hub):
    with pytest.raises(ModelInfoError, match=r"no/such-model: no such model on the Hub \(404\)"):
        find_model("no/such-model")
    with pytest.raises(ModelInfoError, match="cannot read it as JSON"):
        find_model("broken/model")
    assert not cached_config("broken/model").exists()


def test_a_config_json_path_and_a_model_folder_are_read_where_they_are(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN))
    by_file = find_model(str(folder / "config.json"))
    by_folder = find_model(str(folder))
    assert (by_file.where, by_folder.where) == ("config.json file", "model folder")
    assert by_file.info.hidden == by_folder.info.hidden == 3584
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelInfoError, match="this folder has no config.json"):
        find_model(str(tmp_path / "empty"))
    with pytest.raises(ModelInfoError, match="no such file or folder"):
        find_model(str(tmp_path / "nowhere" / "config.json"))


def test_an_architecture_it_cannot_model_is_refused_from_the_hub_too(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "phimoe", "hidden_size": 4096, "num_local_experts": 16}))
    with pytest.raises(ModelInfoError, match=r"mixture-of-experts layers \(num_local_experts: 16\)"):
        find_model(str(path))


def test_the_offline_hint_names_a_command_huggingface_hub_installs() -> None:
    """The estimate of a model Studio cannot find offline says how to download its config.json:
    with a command the installed huggingface_hub provides (``hf``; ``huggingface-cli`` is gone)."""
    import re
    import shutil
    import sys
    from pathlib import Path

    from studio.core.model.info import load_model_info

    with pytest.raises(ModelInfoError) as refused:
        load_model_info("no-such-owner/no-such-model")
    command = re.search(r"\((\S+) download no-such-owner/no-such-model config\.json\)", str(refused.value))
    assert command is not None, str(refused.value)
    installed = shutil.which(command.group(1), path=str(Path(sys.executable).parent))
    assert installed is not None, f"{command.group(1)} is not installed beside {sys.executable}"
