"""The Triton kernel behind :mod:`studio.engine.fast.cross_entropy` (jitted on first use: this module
imports Triton, so nothing imports it until the kernel runs).

One program a row of a chunk of logits (``[rows, vocab]``, the head's product in the compute dtype):
a first pass over the row keeps, lane by lane, the running maximum and the sum of exponentials
(fp32), so the row's log-sum-exp needs no tensor of its own; the loss is that less the target's
logit; a second pass writes the gradient ``(softmax - onehot) * scale`` over the logits, rounded
once to their dtype. ``CAP``: the logits are soft-capped first, ``cap * tanh(z / cap)`` (Gemma 2's
final soft-cap), and the gradient goes through the cap (``1 - tanh^2``). A row whose target is
``IGNORE`` (-100) has no loss and a zero gradient.

In Triton's interpreter (``INTERPRETED``: the CPU tests) the row's maximum and sum go through
``tl.reduce`` with ``GREATEST`` and ``ADD`` (:func:`greatest`, :func:`add`, jitted by the caller):
``tl.max`` and ``tl.sum`` are jitted helpers of Triton's own, which the interpreter cannot call when
Triton was imported before ``TRITON_INTERPRET`` was set. tanh is written out (:func:`tanh`: older
Tritons have no ``tl.tanh``), from ``exp(-2|x|)``, which never overflows; a function of its own (Triton
inlines it, cross_entropy.py's ``KERNELS`` jits it with the kernel) so that its temporaries stay its
own: Triton's compiler (not its interpreter) rejects a name that is a scalar before a loop and a
block inside it, as the target's capped logit and a block's would be in the kernel's one scope.
"""

import triton.language as tl


def add(a, b):
    return a + b


def greatest(a, b):
    return tl.maximum(a, b)


def tanh(x):
    """``tanh(x)`` (fp32), from ``exp(-2|x|)`` (at most 1: no overflow for any ``x``)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


def cross_entropy_rows(logits_ptr, targets_ptr, losses_ptr, scale_ptr, n_cols, stride, cap, BLOCK: tl.constexpr,
                       CAP: tl.constexpr, GRAD: tl.constexpr, INTERPRETED: tl.constexpr, ADD: tl.constexpr,
                       GREATEST: tl.constexpr):
    """Row ``program_id``'s loss into ``losses_ptr`` (fp32) and, with ``GRAD``, its gradient times
    ``scale`` (an fp32 scalar on the device: 1 / the target count for a mean) over its logits."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    valid = target != -100
    lanes = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        inside = cols < n_cols
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if CAP:
            z = tanh(z / cap) * cap
        z = tl.where(inside, z, float("-inf"))
        new_top = tl.maximum(top, z)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a lane that has seen no column yet
        total = total * tl.exp(top - shift) + tl.exp(z - shift)
        top = new_top
    if INTERPRETED:
        most = tl.reduce(top, 0, GREATEST)
        lse = most + tl.log(tl.reduce(total * tl.exp(top - most), 0, ADD))
    else:
        most = tl.max(top, axis=0)
        lse = most + tl.log(tl.sum(total * tl.exp(top - most), axis=0))
    picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    if CAP:
        picked = tanh(picked / cap) * cap
    tl.store(losses_ptr + row, tl.where(valid, lse - picked, 0.0))
    if GRAD:
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            inside = cols < n_cols
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            if CAP:
                t = tanh(x / cap)
                g = tl.exp(t * cap - lse)
            else:
                g = tl.exp(x - lse)
            g = tl.where(cols == target, g - 1.0, g)
            if CAP:
                g = g * (1.0 - t * t)
            tl.store(base + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=inside)
