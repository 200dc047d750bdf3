"""``studio push``: through huggingface_hub to a local HTTP server standing in for the Hub (HF_ENDPOINT on
127.0.0.1; it answers the four calls an upload makes: create the repo, check the card's YAML, ask
how to upload each file, commit); and one-line errors without a token, offline, or with no Hub."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.cli import run_studio

pytest.importorskip("huggingface_hub")

from studio.cli.export import PushError, upload  # noqa: E402
from studio.core.runs import RunDir, create_run  # noqa: E402


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's upload endpoints, recording what arrives (class attributes, reset per test)."""

    created: list[dict] = []
    files: dict[str, bytes] = {}
    tokens: set[str] = set()

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(404, {"error": "not served here"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.tokens.add(self.headers.get("Authorization", ""))
        host = "http://" + self.headers["Host"]
        if self.path == "/api/repos/create":
            request = json.loads(body)
            self.created.append(request)
            return self._answer(200, {"url": f"{host}/{request['organization']}/{request['name']}"})
        if self.path == "/api/validate-yaml":
            return self._answer(200, {"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            # Every file as a regular (inline base64) upload, so no LFS or Xet storage is needed.
            wanted = json.loads(body)["files"]
            return self._answer(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                for f in wanted]})
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.removeprefix("/api/models/").split("/commit/")[0]
            return self._answer(200, {"commitUrl": f"{host}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
        self._answer(404, {"error": f"{self.path} is not served here"})


@pytest.fixture
def hub() -> Iterator[str]:
    FakeHub.created, FakeHub.files, FakeHub.tokens = [], {}, set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def adapter_run(tiny_config, tmp_path: Path) -> RunDir:
    """A run with a saved (random, untrained) LoRA adapter on the tiny model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = create_run(tiny_config)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_config.model.base_model),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(run.adapter_dir)
    return run


def _push(run: RunDir, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return run_studio("push", str(run.path), *extra, env=env, timeout=300)


@pytest.fixture
def push_env(studio_env: dict, tmp_path: Path) -> dict:
    env = {k: v for k, v in studio_env.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), STUDIO_LOCK_DIR=str(tmp_path / "locks"), STUDIO_WORKER_LINGER="3")
    return env


def test_push_uploads_the_exported_adapter_to_the_hub(adapter_run: RunDir, hub: str, push_env: dict) -> None:
    env = {**push_env, "HF_ENDPOINT": hub, "HF_TOKEN": "hf_studio_test"}
    done = _push(adapter_run, env, "--repo", "someone/reverse-lora", "--private")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{hub}/someone/reverse-lora"
    assert FakeHub.created == [{"name": "reverse-lora", "organization": "someone", "visibility": "private",
                                "type": "model"}]
    assert FakeHub.tokens == {"Bearer hf_studio_test"}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "prompt_template.txt"} <= set(FakeHub.files)
    assert FakeHub.files["adapter_model.safetensors"] == (adapter_run.adapter_dir / "adapter_model.safetensors").read_bytes()
    assert json.loads(FakeHub.files["adapter_config.json"])["base_model_name_or_path"] == \
        adapter_run.config().model.base_model
    assert FakeHub.files["README.md"].startswith(b"---\nlibrary_name: \"peft\"")


@pytest.mark.parametrize(("extra_env", "args", "expected"), [
    ({}, ("--repo", "someone/x"), "error: no Hugging Face token found; run 'hf auth login'"),
    ({"HF_TOKEN": "t", "HF_HUB_OFFLINE": "1"}, ("--repo", "someone/x"), "error: HF_HUB_OFFLINE is set"),
    ({"HF_TOKEN": "t"}, ("--repo", "just-a-name"), "error: --repo 'just-a-name': give --repo as user/name"),
])
def test_push_refusals_are_one_line(adapter_run: RunDir, push_env: dict, extra_env: dict,
                                    args: tuple, expected: str) -> None:
    done = _push(adapter_run, {**push_env, **extra_env}, *args)
    assert done.returncode == 1
    assert done.stderr.strip().startswith(expected) and len(done.stderr.strip().splitlines()) == 1
    assert not (adapter_run.path / "export").exists(), "nothing is exported before the checks pass"


def test_an_unreachable_hub_is_one_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as constants

    (tmp_path / "README.md").write_text("hi\n")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(PushError, match=r"cannot reach the Hub at http://127.0.0.1:9 .*check the network"):
        upload(tmp_path, "someone/x", "token", private=False, message="m")


def test_push_merged_uploads_safetensors_and_tokenizer(adapter_run: RunDir, hub: str, push_env: dict) -> None:
    from safetensors.torch import load

    env = {**push_env, "HF_ENDPOINT": hub, "HF_TOKEN": "hf_studio_test"}
    done = _push(adapter_run, env, "--repo", "someone/reverse-merged", "--merged")
    assert done.returncode == 0, done.stderr
    assert FakeHub.created[0]["visibility"] == "public"
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(FakeHub.files)
    weights = load(FakeHub.files["model.safetensors"])
    assert str(weights["model.layers.0.self_attn.q_proj.weight"].dtype) == "torch.bfloat16"
    assert not any("lora" in name for name in weights)
