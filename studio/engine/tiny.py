"""A tiny Llama-architecture model and tokenizer, built locally, for tests and demos.

Nothing can be downloaded at test time, so the project makes its own model: a 2-layer Llama
(hidden 128, 4 heads) with random weights from a fixed seed, and a byte-level BPE tokenizer trained
with ``tokenizers`` on the bundled sample data plus the "reverse the word" task text. Both are saved
with ``save_pretrained`` into ``cache_dir()/tiny-llama`` and reused.

The toy task: reverse the letters of a word written with dashes (``s-t-o-n-e`` -> ``e-n-o-t-s``).
The dashes make every letter its own pre-token, so each letter is one token in the prompt and in the
answer. A purely random model cannot be taught this by a small LoRA: its frozen attention has no
way to find a token by position, so the adapter has nothing to steer (measured: 0% after 1500
steps). So the build gives the model one skill first, like a real base model has many: a few hundred
full-parameter steps of *copying* words (``Repeat the letters of the word.``). Its answers to the
reverse task are then copies (0% exact match, palindromes excluded), and a LoRA fine-tune of 300
steps learns to reverse (about 45% exact match on held-out words).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from studio.core.paths import cache_dir, sample_data_dir

TINY_NAME = "tiny-llama"
TINY_VERSION = 2
"""Bumped when the recipe changes, so a stale cached build is rebuilt."""

VOCAB_SIZE = 1024
PRETRAIN_STEPS = 600
"""Full-parameter steps of the copy task that give the random model its only skill (see module doc)."""
TINY_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
"""A short prompt template: the tiny model's examples stay ~40 tokens, so tests run fast."""
COPY_INSTRUCTION = "Repeat the letters of the word."

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
REVERSE_INSTRUCTION = "Reverse the letters of the word."
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reverse_word_rows(n: int, seed: int = 0, min_len: int = 3, max_len: int = 5,
                      val_fraction: float = 0.1, test_fraction: float = 0.1) -> list[dict]:
    """``n`` distinct "reverse the word" rows (instruction / input / output / split 0,1,2), seeded."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(min_len, max_len)))
        # Palindromes are left out: copying them is reversing them, which would flatter the base.
        if word not in seen and word != word[::-1]:
            seen.add(word)
            words.append(word)
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    rows = []
    for i, word in enumerate(words):
        split = 2 if i < n_test else 1 if i < n_test + n_val else 0
        rows.append({"instruction": REVERSE_INSTRUCTION, "input": "-".join(word),
                     "output": "-".join(reversed(word)), "split": split})
    return rows


def _corpus() -> Iterator[str]:
    """Text the tokenizer learns from: the bundled instruction sample and the reverse-word task.
    One named file, not every sample: a sample added later must not change the tiny model (tests,
    snapshots and cached builds depend on its vocabulary)."""
    sample = sample_data_dir() / "code_alpaca_sample.jsonl"
    for path in [sample] if sample.exists() else []:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield "\n".join(str(v) for v in row.values() if isinstance(v, str))
    # Template scaffolding that every prompt contains, so it becomes a few tokens.
    scaffold = ("Below is an instruction that describes a task. Write a response that appropriately "
                "completes the request.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n{}")
    for row in reverse_word_rows(2000, seed=1234):
        yield scaffold.format(row["instruction"], row["input"], row["output"])


def build_tiny_model(dir: str | Path | None = None, progress: Callable[[str], None] | None = None,
                     pretrain_steps: int = PRETRAIN_STEPS, batch_size: int = 8,
                     learning_rate: float = 1e-3) -> Path:
    """Build (or reuse) the tiny Llama model + tokenizer; returns the folder to load it from.

    ``dir`` defaults to ``cache_dir()/tiny-llama``. A complete build there is reused; a partial one
    (interrupted) is rebuilt. The folder loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``; ``tokenizer.json`` loads with ``tokenizers`` alone.
    """
    target = Path(dir) if dir is not None else cache_dir() / TINY_NAME
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may ask at once (pytest-xdist workers sharing STUDIO_TEST_CACHE, two
    # `studio pull --tiny`): one builds while the others wait on the lock, then find it complete.
    # The kernel drops the lock if its holder dies, so an interrupted build never blocks the next.
    say = progress or (lambda _msg: None)
    with open(target.with_name(target.name + ".lock"), "a+b") as lock:
        _flock(lock, lambda: say("another process is building the tiny model; waiting for it"))
        if _complete(target):
            return target
        tmp = target.with_name(target.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        say("training the tiny tokenizer")
        tokenizer = build_tokenizer()
        say("building the tiny model")
        model = _random_model(tokenizer)
        if pretrain_steps:
            say(f"teaching it to copy words ({pretrain_steps} steps)")
            _pretrain(model, tokenizer, pretrain_steps, batch_size, learning_rate)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "studio_tiny.json").write_text(json.dumps({"version": TINY_VERSION}))
        # Renamed into place: a reader that checks the marker never sees half a model.
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    say(f"tiny model ready in {target}")
    return target


def _complete(target: Path) -> bool:
    """Whether ``target`` holds a finished build of this recipe (its marker is written last)."""
    try:
        return json.loads((target / "studio_tiny.json").read_text()).get("version") == TINY_VERSION
    except (OSError, ValueError):
        return False


def _flock(handle, waiting: Callable[[], None]) -> None:
    """Block until this process holds an exclusive lock on ``handle``, calling ``waiting`` first if
    another holds it (no-op where there is no fcntl)."""
    try:
        import fcntl
    except ImportError:  # not on Linux or macOS: builds are not guarded against each other there
        return
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        waiting()
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)


def build_tokenizer():  # -> PreTrainedTokenizerFast
    """The tiny byte-level BPE tokenizer (vocab <= 1024, pad/bos/eos), trained in about a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=512, clean_up_tokenization_spaces=False)


def _random_model(tokenizer):  # -> LlamaForCausalLM
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        # A fixed size (the tokenizer may learn fewer merges from a smaller corpus): the random
        # initialisation then does not shift when the sample data changes.
        vocab_size=max(VOCAB_SIZE, len(tokenizer)), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        # ~1/sqrt(hidden): with the usual 0.02, a random 128-wide model has near-uniform attention and
        # tiny logits, and an adapter needs thousands of steps to grow large enough to matter.
        initializer_range=0.1,
        # Tied embeddings (as in SmolLM2) let a frozen random model copy tokens: the output layer
        # scores a token by its own embedding, so moving an embedding forward predicts that token.
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _pretrain(model, tokenizer, steps: int, batch_size: int, learning_rate: float) -> None:
    """Full-parameter training on "repeat the word" rows (the words of the test data excluded)."""
    import torch
    import torch.nn.functional as F

    from studio.core.prompt import IGNORE_INDEX, encode, render
    from studio.engine.batching import Cursor, DataStream

    examples = []
    for row in reverse_word_rows(4000, seed=99, val_fraction=0, test_fraction=0):
        row = {**row, "instruction": COPY_INSTRUCTION, "output": row["input"]}
        examples.append(encode(render(TINY_TEMPLATE, row), lambda t: tokenizer.encode(t, add_special_tokens=False),
                               64, tokenizer.eos_token_id))
    stream = DataStream(examples, seed=0, packing=False, max_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    cursor = Cursor()
    model.train()
    torch.manual_seed(0)
    for _ in range(steps):
        units, cursor = stream.take(cursor, batch_size)
        batch = stream.collate(units, tokenizer.pad_token_id)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        targets = batch.labels[:, 1:]
        keep = targets != IGNORE_INDEX
        loss = F.cross_entropy(logits[:, :-1][keep], targets[keep])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
