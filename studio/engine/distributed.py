"""Data parallel across the processes torchrun starts: one GPU (or, in tests, one CPU process) a rank.

:func:`current` joins the process group once per process (from torchrun's RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT) and returns the :class:`Group`; outside torchrun it is a
group of one whose collectives return at once, so the Trainer has one code path.

What crosses processes, where, and why there:

- the LoRA gradients: after a step's micro-batches, one all-reduce (sum) of every trainable
  gradient, flattened into one buffer, on the default group (NCCL on CUDA). It happens after the
  fast path's captured CUDA graphs have written the gradients and before clipping, so the graphs
  stay whole and clipping sees the global gradient. The step's loss sum rides in the same buffer.
- the step's token counts and the out-of-memory flag: small CPU all-reduces on a gloo group (every
  rank divides by the same global token count, and halves its micro-batch together with the others).
- rank 0's verdict after each step (go on, stop, or "still paused") by broadcast on the gloo group.
  While paused rank 0 repeats "paused" every ~0.25 s, so the other ranks wait in short CPU
  collectives instead of a GPU kernel spinning for hours; the gloo group's timeout is long (a
  person may pause for a day), while torchrun notices a rank that dies and ends the others.
- what the other ranks should do next (train, resume, exit) while rank 0's worker serves chat:
  broadcast on the gloo group (:meth:`Group.instruct`, :meth:`Group.next_instruction`).
- RNG states for checkpoints and memory samples for the VRAM pane: gathered to rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

T = TypeVar("T")

GO, STOP, PAUSED = 0, 1, 2
"""Rank 0's verdicts after an optimizer step."""

CONTROL_TIMEOUT = timedelta(days=7)
"""How long a rank waits on the gloo group for rank 0 (a pause, chat while idle)."""


class DistributedError(RuntimeError):
    """The process group cannot be formed; the message says what to do."""


@dataclass
class Group:
    """This process's place among the run's processes; a group of one outside torchrun."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None
    """This rank's device (``cuda:LOCAL_RANK``, or the CPU), None for a group of one (the session picks)."""
    control: Any = None
    """The gloo group for CPU messages (verdicts, counts, instructions)."""

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the worker that serves commands, writes events, checkpoints and the adapter."""
        return self.rank == 0

    def shard(self, units: list[T]) -> list[T]:
        """This rank's share of a step's units: every world-th from its rank, so no two ranks share
        one and shares differ by at most one unit (a share may be empty)."""
        return units[self.rank::self.world] if self.active else units

    def sum_counts(self, *counts: int) -> list[int]:
        """``counts`` summed over every rank (a CPU all-reduce)."""
        if not self.active:
            return list(counts)
        import torch.distributed as dist

        values = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(values, group=self.control)
        return [int(v) for v in values]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return bool(self.sum_counts(int(flag))[0]) if self.active else flag

    def reduce_gradients(self, params: list[torch.Tensor], loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum every rank's gradients of ``params`` in place, in one all-reduce, and return the
        summed ``loss_sum``. A parameter without a gradient (a rank with no units) counts as zero."""
        if not self.active:
            return loss_sum
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # fp32 buffer: the gradients' own dtype (LoRA weights are fp32) and the loss sum's.
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.reshape(1).float()])
        dist.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            n = grad.numel()
            grad.copy_(flat[offset:offset + n].view_as(grad))
            if param.grad is None:
                param.grad = grad
            offset += n
        return flat[-1]

    def broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        """Give every rank rank 0's values of ``params`` (the LoRA at the start of training)."""
        if not self.active:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for param in params:
                dist.broadcast(param.data, src=0)

    def verdict(self, decide: Any) -> int:
        """Rank 0 calls ``decide()`` (GO, STOP; it may call :meth:`still_paused` meanwhile) and
        every rank returns its answer; the other ranks wait through the PAUSED repeats."""
        if not self.active:
            return int(decide())
        if self.leader:
            code = int(decide())
            self._broadcast_code(code)
            return code
        code = PAUSED
        while code == PAUSED:
            code = self._broadcast_code(0)
        return code

    def still_paused(self) -> None:
        """Rank 0, while paused: tell the other ranks to keep waiting."""
        if self.active and self.leader:
            self._broadcast_code(PAUSED)

    def _broadcast_code(self, code: int) -> int:
        import torch.distributed as dist

        value = torch.tensor([code], dtype=torch.int64)
        dist.broadcast(value, src=0, group=self.control)
        return int(value[0])

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the others."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def instruct(self, instruction: dict[str, Any]) -> None:
        """Rank 0: tell the waiting ranks what to do next (``{"do": "train", "resume": bool}`` or
        ``{"do": "exit"}``)."""
        if self.active and self.leader:
            import torch.distributed as dist

            dist.broadcast_object_list([instruction], src=0, group=self.control)

    def next_instruction(self) -> dict[str, Any]:
        """The other ranks: wait for rank 0's next :meth:`instruct`."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return dict(box[0])

    def close(self) -> None:
        """Leave the process group (after the last collective)."""
        if self.active:
            import torch.distributed as dist

            dist.destroy_process_group()


def resume_note(saved_on: int, world: int, units_per_step: int, accumulation: int) -> str:
    """What changes when a run checkpointed on ``saved_on`` processes resumes on ``world``."""
    return (f"resuming on {world} process{'es' if world > 1 else ''} a run checkpointed on {saved_on}: the "
            f"effective batch stays {units_per_step} and every step sees the same rows; accumulation becomes "
            f"{accumulation} a rank, and the dropout masks (lora.dropout > 0) differ from an uninterrupted run")


_group: Group | None = None


def current() -> Group:
    """This process's group, joined on first use (a group of one outside torchrun). Raises
    DistributedError with what to do when the group cannot be formed."""
    global _group
    if _group is None:
        _group = _join()
    return _group


def _join() -> Group:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Group()
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    on_cuda = os.environ.get("STUDIO_DEVICE", "") != "cpu" and torch.cuda.is_available()
    if on_cuda:
        if not dist.is_nccl_available():
            raise DistributedError("this torch build has no NCCL, which multi-GPU training needs; install "
                                   "torch's CUDA build (pip install torch) or train on one GPU (--gpus 1)")
        if local >= torch.cuda.device_count():
            raise DistributedError(f"rank {rank} wants GPU {local} but this process sees "
                                   f"{torch.cuda.device_count()}; check CUDA_VISIBLE_DEVICES or use fewer --gpus")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        if not dist.is_gloo_available():
            raise DistributedError("this torch build has no gloo backend; train with --gpus 1")
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Group(rank=rank, world=world, device=device, control=control)
