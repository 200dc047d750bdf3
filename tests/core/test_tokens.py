"""core/prompt/tokens.py: the tokenizer from a folder, Studio's cache or the hub cache; no torch, no download."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from studio.core.prompt.tokens import TokenizerNotFound, count_tokens, load_tokenizer, load_tokenizer_info

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def make_model_folder(folder: Path, *, chat_in_jinja_file: bool = False) -> Path:
    """A model folder as transformers saves one: tokenizer.json plus tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def reverse(text): return text[::-1]"] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": "<s>"}
    if chat_in_jinja_file:
        (folder / "chat_template.jinja").write_text(CHAT)
        config["chat_template"] = "ignored: the .jinja file wins"
    else:
        config["chat_template"] = CHAT
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_local_folder_gives_tokenizer_special_ids_and_chat_template(tmp_path):
    folder = make_model_folder(tmp_path / "model")
    info = load_tokenizer_info(folder)
    assert info.folder == folder
    assert info.eos_token == "<|im_end|>" and info.eos_id == info.tokenizer.token_to_id("<|im_end|>") == 1
    assert info.bos_id == 0 and info.add_bos  # the post-processor prepends <s>
    assert info.chat_template == CHAT
    # A path to tokenizer.json itself works too.
    assert load_tokenizer(folder / "tokenizer.json").get_vocab_size() == info.tokenizer.get_vocab_size()


def test_chat_template_jinja_file_wins(tmp_path):
    info = load_tokenizer_info(make_model_folder(tmp_path / "model", chat_in_jinja_file=True))
    assert info.chat_template == CHAT


def test_hub_cache_snapshot_is_found_without_downloading(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-model"
    make_model_folder(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("STUDIO_CACHE", str(tmp_path / "studio"))
    info = load_tokenizer_info("someone/tiny-model")
    assert info.folder == repo / "snapshots" / "abc123"


def test_studio_cache_is_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_CACHE", str(tmp_path / "studio"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    make_model_folder(tmp_path / "studio" / "models" / "someone--tiny-model")
    assert load_tokenizer_info("someone/tiny-model").eos_id == 1


def test_missing_tokenizer_says_where_it_looked_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_CACHE", str(tmp_path / "studio"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TokenizerNotFound) as err:
        load_tokenizer("nobody/no-model")
    message = str(err.value)
    assert message.startswith("nobody/no-model: no tokenizer.json")
    assert str(tmp_path / "studio") in message and str(tmp_path / "hub") in message
    assert "studio pull nobody/no-model" in message


def test_counts_match_single_encodes_and_skip_special_tokens(tmp_path):
    info = load_tokenizer_info(make_model_folder(tmp_path / "model"))
    texts = ["def reverse(text):", "", "return text[::-1]" * 3, None]

    def tokenize(text: str) -> list[int]:
        return info.tokenizer.encode(text, add_special_tokens=False).ids

    expected = [len(tokenize(t or "")) for t in texts]
    assert count_tokens(info.tokenizer, texts) == expected
    assert count_tokens(tokenize, texts) == expected
    assert info.bos_id not in tokenize("def")  # no <s> from the post-processor
    assert expected[1] == 0 and expected[2] > expected[0]


def test_count_tokens_reports_progress_per_batch(tmp_path):
    info = load_tokenizer_info(make_model_folder(tmp_path / "model"))
    seen = []
    counts = count_tokens(info.tokenizer, ["def x"] * 20_000, lambda done, total: seen.append((done, total)))
    assert len(counts) == 20_000
    assert seen == [(8192, 20_000), (16384, 20_000), (20_000, 20_000)]


def test_tokens_never_imports_torch_or_transformers(tmp_path):
    folder = make_model_folder(tmp_path / "model")
    code = (
        "import sys\nfrom studio.core.prompt.tokens import load_tokenizer_info, count_tokens\n"
        f"info = load_tokenizer_info({str(folder)!r}); count_tokens(info.tokenizer, ['a b'])\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
