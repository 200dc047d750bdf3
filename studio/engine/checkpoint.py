"""Resumable checkpoints: ``checkpoints/step-N/`` with everything a run needs to continue exactly.

A checkpoint holds the adapter (``adapter/``, loadable by ``PeftModel.from_pretrained``; a full
fine-tune's whole model in ``model/`` instead, as ``save_pretrained`` writes it), the
optimizer and scheduler states, the RNG states (python, numpy, torch, CUDA) and the trainer's own
state as JSON (step, data cursor, micro-batch and accumulation, best eval loss). A data-parallel run
adds each other rank's RNG states as ``rng-rank-R.pt``; the rest is the same on every rank. It is written into a
temp folder, synced to the disk and renamed into place, so a crash, a full disk or a power cut
mid-write leaves the previous checkpoint intact (and :meth:`studio.core.runs.RunDir.checkpoints`
never lists the temp folder, which a failed write removes).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from studio.core.runs import RunDir
from studio.core.runs.storage import replace_folder, sync_tree

STATE_FILE = "trainer_state.json"


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) for a repeatable run."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every random generator's state, for :func:`set_rng_state`."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put every random generator back where :func:`rng_state` found it."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run: RunDir, step: int, model: Any, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], keep: int,
         rank_rng: list[dict[str, Any]] | None = None) -> Path:
    """Write ``checkpoints/step-<step>`` atomically and delete all but the newest ``keep``;
    ``rank_rng`` holds the RNG states of ranks 1, 2, ... of a data-parallel run."""
    final = run.checkpoints_dir / f"step-{step}"
    tmp = run.checkpoints_dir / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp / ("adapter" if is_peft(model) else "model")))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        for rank, states in enumerate(rank_rng or [], start=1):
            torch.save(states, tmp / f"rng-rank-{rank}.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
        sync_tree(tmp)  # on the disk before the rename publishes it: whole even after a power cut
    except BaseException:
        # A full disk (or an out-of-memory copy) half way: the space goes back, the older
        # checkpoints were never touched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The same step may be saved twice (a stop right after an interval checkpoint): replaced whole.
    replace_folder(tmp, final)
    for old in run.checkpoints()[:-max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def is_peft(model: Any) -> bool:
    """True for a model with a LoRA adapter, False for a full fine-tune's plain model."""
    return hasattr(model, "peft_config")


def read_model_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a full model saved by ``save_pretrained`` (one file or shards), on the CPU:
    a resume must not hold a second copy of every weight on the GPU."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file), device="cpu"))
    return weights


def copy_model_weights(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy saved weights into ``model``'s parameters in place (the optimizer keeps pointing at the
    same tensors). Tied weights are saved once, under the first name ``named_parameters`` gives them.
    Raises ValueError naming a parameter the file lacks (another model's weights)."""
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in weights]
    if missing:
        raise ValueError(f"the saved weights have no {missing[0]} ({len(missing)} parameters missing): "
                         "they are another model's")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def load_model_weights(model: Any, folder: Path) -> None:
    """Put a full fine-tune's saved weights (``model/``) into ``model`` in place."""
    copy_model_weights(model, read_model_weights(folder))


def load_adapter_weights(model: Any, adapter_dir: Path, device: torch.device | str) -> list[str]:
    """Copy a saved adapter's weights (``adapter_model.safetensors``) into ``model``'s LoRA in place,
    so the optimizer and the fast path keep pointing at the same tensors. Returns the saved keys that
    matched no LoRA weight of ``model`` (an adapter made with other ``lora.target_modules``).
    A shape mismatch (another ``lora.r``) raises RuntimeError."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(device))
    result = set_peft_model_state_dict(model, weights)
    return list(getattr(result, "unexpected_keys", []) or [])


def read(path: Path, device: torch.device | str, rank: int = 0) -> dict[str, Any]:
    """Every file of the checkpoint at ``path``, read and checked without touching the model: a
    truncated or missing file raises here (OSError, RuntimeError, ValueError, pickle's errors...),
    so a resume can fall back to an older checkpoint with nothing half restored. Rank R > 0 of a
    data-parallel run reads ``rng-rank-R.pt``; a rank the checkpoint has none for (resumed on more
    processes than it was saved on) gets None and keeps the RNG it has."""
    from safetensors.torch import load_file

    rng = path / ("rng.pt" if rank == 0 else f"rng-rank-{rank}.pt")
    state = json.loads((path / STATE_FILE).read_text())
    for key in ("step", "cursor", "micro_batch_size", "units_per_step"):
        if key not in state:
            raise ValueError(f"{STATE_FILE} has no {key!r}")
    full = (path / "model").is_dir()
    return {
        "adapter": None if full else load_file(str(path / "adapter" / "adapter_model.safetensors"),
                                               device=str(device)),
        "model": read_model_weights(path / "model") if full else None,
        # Our own files: full unpickling is needed for the optimizer's and RNG's python objects.
        "optimizer": torch.load(path / "optimizer.pt", map_location=device, weights_only=False),
        "scheduler": torch.load(path / "scheduler.pt", weights_only=False),
        "rng": torch.load(rng, weights_only=False) if rank == 0 or rng.exists() else None,
        "state": state,
    }


def apply(files: dict[str, Any], model: Any, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Put what :func:`read` returned into the model's LoRA or, for a full fine-tune, its weights (in
    place), the optimizer, the scheduler
    and the random generators; returns the trainer state.

    Call it after the optimizer and scheduler are built (their states are loaded into them) and
    after everything else that draws random numbers, so the restored RNG is what the next step sees.
    """
    from peft.utils import set_peft_model_state_dict

    if files.get("model") is not None:
        if is_peft(model):
            raise ValueError("the checkpoint holds a full fine-tune's weights but the model has a LoRA "
                             "(was 'lora' changed in config.yaml after training?)")
        copy_model_weights(model, files["model"])
    elif not is_peft(model):
        raise ValueError("the checkpoint holds a LoRA adapter but the run is a full fine-tune "
                         "(was 'lora: null' set in config.yaml after training?)")
    else:
        set_peft_model_state_dict(model, files["adapter"])
    optimizer.load_state_dict(files["optimizer"])
    scheduler.load_state_dict(files["scheduler"])
    if files["rng"] is not None:
        set_rng_state(files["rng"])
    return files["state"]


def load(path: Path, model: Any, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device, rank: int = 0) -> dict[str, Any]:
    """Restore adapter weights, optimizer, scheduler and RNG from ``path``; returns the trainer state
    (:func:`read`, then :func:`apply`)."""
    return apply(read(path, device, rank), model, optimizer, scheduler)
