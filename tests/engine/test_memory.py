"""engine/memory.py against the estimator on a real (tiny) model: the static categories must agree."""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from studio.core.memory import Plan, estimate_plan  # noqa: E402
from studio.core.model.info import from_config_dict  # noqa: E402
from studio.engine.memory import measure_memory  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)


def _trained(tmp_path, bits, targets, optimizer="adamw"):
    """A tiny Llama loaded like a checkpoint, with LoRA, after one optimizer step."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    kwargs = {"dtype": torch.bfloat16}
    if bits == 4:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
    if bits:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets),
                                                       lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    # On a CUDA machine bitsandbytes puts a 4-bit model on the GPU: the batch follows the model.
    device = next(model.parameters()).device
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return model, opt, config


@pytest.mark.parametrize("bits,weights", [(None, "bf16"), (4, "nf4")])
def test_measured_static_categories_match_the_estimate(tmp_path, bits, weights):
    targets = ("q_proj", "v_proj") if bits is None else ("q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj")
    model, opt, config = _trained(tmp_path, bits, targets)
    device = next(model.parameters()).device  # a 4-bit model is on the GPU where there is one
    measured = measure_memory(model, opt, device)
    info = from_config_dict(config.to_dict(), "tiny")
    # the training step's categories: what a step leaves measured (another phase may set the run's peak)
    predicted = estimate_plan(info, Plan(weights=weights, lora_r=8, lora_targets=targets)).step_categories
    # adapters, their gradients and AdamW's m and v are exact; weights within the buffers (rotary)
    assert measured["lora"] == predicted["lora"]
    assert measured["gradients"] == predicted["gradients"]
    assert measured["optimizer"] == predicted["optimizer"]
    assert measured["weights"] == pytest.approx(predicted["weights"], rel=0.02)
    if device.type == "cpu":  # off CUDA there is no allocator peak to read
        assert measured["activations"] == 0 and measured["overhead"] == 0
    else:  # on CUDA the step that ran left a peak above the static categories
        assert measured["activations"] > 0


def test_gradients_are_counted_when_freed_between_steps(tmp_path):
    model, opt, _ = _trained(tmp_path, None, ("q_proj",))
    before = measure_memory(model, opt, "cpu")["gradients"]
    opt.zero_grad(set_to_none=True)
    after = measure_memory(model, opt, "cpu")["gradients"]
    assert before == after > 0


class _FakeNvml:
    """The slice of pynvml that process_gpu_bytes uses: two cards, processes on each."""

    def __init__(self, procs_by_card):
        self.procs_by_card = procs_by_card
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return len(self.procs_by_card)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.procs_by_card[handle]]


def test_context_is_what_the_driver_charges_this_process_beyond_torchs_pool(monkeypatch):
    from studio.engine import memory

    me = os.getpid()
    fake = _FakeNvml([[(me + 1, 9 * 2**30), (me, 7 * 2**30)], [(me, 2**30)]])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(memory, "_NVML", None)
    assert memory.process_gpu_bytes() == 8 * 2**30  # both cards, only this process
    assert memory.process_gpu_bytes() == 8 * 2**30
    assert fake.inits == 1  # initialised once: the training loop asks every logged step
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * 2**30 + 512 * 2**20)
    assert memory.context_bytes(torch.device("cuda")) == 512 * 2**20
    # a PID namespace hides the process from the driver: nothing is guessed
    monkeypatch.setattr(memory, "_NVML", _FakeNvml([[(me + 1, 2**30)]]))
    assert memory.process_gpu_bytes() is None
    assert memory.context_bytes(torch.device("cuda")) == 0


def test_no_driver_means_no_context_and_no_retry(monkeypatch):
    from studio.engine import memory

    class Broken:
        tries = 0

        def nvmlInit(self):
            Broken.tries += 1
            raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", Broken())
    monkeypatch.setattr(memory, "_NVML", None)
    assert memory.process_gpu_bytes() is None
    assert memory.process_gpu_bytes() is None
    assert Broken.tries == 1


def test_sampler_walks_the_model_once_and_asks_the_driver_at_most_every_few_seconds(monkeypatch):
    """MemorySampler is sample() at a cost a step does not notice: the parameters' bytes are
    measured once (they do not change while training), the optimizer's state again only when it
    holds another number of parameters' state (AdamW makes it at the first step), and the NVML
    query is throttled; the allocator's counters, and so activations and peaks, are read at every call."""
    from types import SimpleNamespace

    from studio.engine import memory

    model = torch.nn.Linear(8, 4)
    walks, optim_walks, asks, sampled = [], [], [], []
    real_walk = memory.parameter_bytes
    monkeypatch.setattr(memory, "parameter_bytes", lambda m: (walks.append(m), real_walk(m))[1])
    monkeypatch.setattr(memory, "optimizer_bytes",
                        lambda opt, device: (optim_walks.append(len(opt.state)), (len(opt.state) * 10, 0))[1])
    monkeypatch.setattr(memory, "context_bytes", lambda device: (asks.append(device), 100 + len(asks))[1])
    monkeypatch.setattr(memory, "sample", lambda *args: (sampled.append(args), args)[1])
    now = [0.0]
    sampler = memory.MemorySampler(model, torch.device("cuda"), rank=1, context_every_s=5.0,
                                   clock=lambda: now[0])
    optimizer = SimpleNamespace(state={})
    for step, t in enumerate([0.0, 1.0, 4.9, 5.0, 6.0, 10.5], start=1):
        now[0] = t
        if step == 2:  # the first step made the state of both parameters
            optimizer.state = {"weight": {}, "bias": {}}
        sampler(optimizer, step)
    assert walks == [model]
    assert optim_walks == [0, 2]
    assert [args[7] for args in sampled] == [(0, 0)] + [(20, 0)] * 5  # the optimizer's bytes passed on
    assert len(asks) == 3  # at 0, 5.0 and 10.5 seconds
    assert [args[6] for args in sampled] == [101, 101, 101, 102, 102, 103]  # the context passed on
    assert all(args[5] == real_walk(model) and args[4] == 1 for args in sampled)
    assert [args[3] for args in sampled] == [1, 2, 3, 4, 5, 6]


def test_sampler_gives_what_sample_gives(tmp_path):
    from studio.engine import memory

    model, opt, _ = _trained(tmp_path, None, ("q_proj", "v_proj"))
    device = next(model.parameters()).device
    if device.type == "cuda":
        pytest.skip("the CPU model: on a GPU the driver's figure moves between two calls")
    sampler = memory.MemorySampler(model, device)
    for step in (3, 4):
        ours, theirs = sampler(opt, step), memory.sample(model, opt, device, step)
        assert dataclasses.replace(ours, time=theirs.time) == theirs  # all but the event's timestamp
        assert ours.categories and ours.categories["lora"] > 0
