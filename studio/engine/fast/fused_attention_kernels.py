"""The Triton kernels behind :mod:`studio.engine.fast.fused_attention` (jitted on first use: this
module imports Triton, so nothing imports it until a kernel runs).

FlashAttention-2's loop order: a program holds a block of queries (the forward, ``dq``) or of keys
(``dk`` and ``dv``) and walks the blocks on the other side that the mask lets through, its scores in
fp32 and never written out. Tokens are laid out ``[B, T, heads, HEAD_DIM]``, contiguous; keys and
values have ``kv_heads`` heads, each shared by ``heads // kv_heads`` query heads. Soft-capped scores
are ``cap * tanh(s / cap)`` with ``s = q.k * scale``; a sink is one more logit in the softmax's
denominator (``sinks [heads]``, fp32). ``SEGMENTS``: one stream of several examples, each token's
example's first and past-last token in ``start_ptr`` / ``end_ptr`` (int32 ``[T]``). ``WINDOW``: a
query sees itself and the ``window - 1`` keys before it. So query ``i`` sees key ``j`` where
``lower(i) <= j <= i``, ``lower(i)`` the latest of its example's start and ``i - window + 1``: two
comparisons a score. Rows past the end load a log-sum-exp of +inf in the backward, so their
weights are 0 without a mask of their own.

What the kernels share (where a block of rows lies, its load and store; the capped scores; which
keys a query sees) is in the device functions before them, which they call by name: Triton inlines
them, and fused_attention.py's ``KERNELS`` jits them with the kernels (its ``helpers``).

In Triton's interpreter (``INTERPRETED``: the CPU tests) row sums and maxima go through
``tl.reduce`` with :func:`add` and :func:`greatest` (``tl.sum`` and ``tl.max`` are jitted helpers the
interpreter cannot call when Triton was imported before ``TRITON_INTERPRET`` was set: norm_kernels.py;
``tl.zeros`` is one too, hence ``tl.full``) and products take fp32 operands (its bf16 products are
wrong). tanh is written out: older Tritons have no ``tl.tanh``. ``HEAD_DIM`` is a constant of the
kernel: where it is the block's width, loads and stores take no mask along it (a mask that varies
along the contiguous axis splits the vector loads).
"""

import triton.language as tl


def add(a, b):
    return a + b


def greatest(a, b):
    return tl.maximum(a, b)


def block_at(tokens, b, head, heads, n_tokens, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where the rows of ``tokens`` of one head of batch row ``b`` start in a ``[B, T, heads,
    HEAD_DIM]`` tensor (int64), and which elements of their block ``[tokens, BLOCK_D]`` it holds."""
    if HEAD_DIM == BLOCK_D:
        inside = (tokens < n_tokens)[:, None]
    else:
        inside = (tokens < n_tokens)[:, None] & (dims < HEAD_DIM)[None, :]
    return ((b * n_tokens + tokens.to(tl.int64)) * heads + head) * HEAD_DIM, inside


def load_block(x_ptr, at, inside, dims, INTERPRETED: tl.constexpr):
    """The block of rows that :func:`block_at` placed, 0 outside the tensor; fp32 in the interpreter."""
    x = tl.load(x_ptr + at[:, None] + dims[None, :], mask=inside, other=0.0)
    if INTERPRETED:
        x = x.to(tl.float32)
    return x


def store_block(x_ptr, at, inside, dims, x):
    """``x`` into the block of rows that :func:`block_at` placed, rounded to the tensor's dtype."""
    tl.store(x_ptr + at[:, None] + dims[None, :], x.to(x_ptr.dtype.element_ty), mask=inside)


def scores(a, b, scale, cap, CAP: tl.constexpr):
    """The scores of rows ``a`` against rows ``b`` in fp32, ``s = a . b * scale``, capped where
    ``CAP`` to ``cap * tanh(s / cap)``; and that tanh, whose square the gradients need (where not
    ``CAP``, the scores again)."""
    s = tl.dot(a, tl.trans(b)) * scale
    if CAP:
        e = tl.exp(-2.0 * tl.abs(s) / cap)
        t = (1.0 - e) / (1.0 + e)  # tanh(|s| / cap)
        t = tl.where(s < 0, -t, t)
        s = t * cap
    else:
        t = s
    return s, t


def earliest_keys(rows, row_in, start_ptr, window, SEGMENTS: tl.constexpr, WINDOW: tl.constexpr):
    """The earliest key each of the queries ``rows`` sees: the later of its example's first token
    and its window's first key; 0 where neither bounds it."""
    if SEGMENTS:
        lower = tl.load(start_ptr + rows, mask=row_in, other=0)
        if WINDOW:
            lower = tl.maximum(lower, rows - window + 1)
    elif WINDOW:
        lower = rows - window + 1
    else:
        lower = tl.full(rows.shape, 0, tl.int32)
    return lower


def keys_seen(m0, rows, row_in, start_ptr, window, BLOCK_N: tl.constexpr, SEGMENTS: tl.constexpr,
              WINDOW: tl.constexpr):
    """For the block of queries ``rows`` from ``m0``: the first key of the first block of keys any
    of them sees (the block's first query sees the earliest), and each one's earliest key."""
    lower = earliest_keys(rows, row_in, start_ptr, window, SEGMENTS, WINDOW)
    lo = 0
    if SEGMENTS:
        lo = tl.load(start_ptr + m0)
    if WINDOW:
        lo = tl.maximum(lo, m0 - window + 1)
    return lo // BLOCK_N * BLOCK_N, lower


def sees(query, key, lower, BOUNDED: tl.constexpr):
    """Whether each query sees each key, their positions broadcast against each other: the key is
    not after the query, nor (``BOUNDED``: by an example or a window) before ``lower``, the query's
    earliest key (:func:`earliest_keys`)."""
    keep = key <= query
    if BOUNDED:
        keep = keep & (key >= lower)
    return keep


def attention_forward(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, start_ptr, sinks_ptr, n_tokens, heads, kv_heads,
                      scale, cap, window, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, CAP: tl.constexpr, WINDOW: tl.constexpr, SEGMENTS: tl.constexpr,
                      SINKS: tl.constexpr, INTERPRETED: tl.constexpr, ADD: tl.constexpr,
                      GREATEST: tl.constexpr):
    """``out = softmax(scores | sink) v`` for one block of queries of one head, and each query's
    log-sum-exp (the sink's term included: what the backward's weights are normalised by)."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    g = h // (heads // kv_heads)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_in = rows < n_tokens
    dims = tl.arange(0, BLOCK_D)
    q_at, q_in = block_at(rows, b, h, heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
    q = load_block(q_ptr, q_at, q_in, dims, INTERPRETED)
    # The keys any query of the block may see: from its first query's earliest to its last query.
    lo, lower = keys_seen(m0, rows, row_in, start_ptr, window, BLOCK_N, SEGMENTS, WINDOW)
    hi = tl.minimum(m0 + BLOCK_M, n_tokens)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_at, kv_in = block_at(cols, b, g, kv_heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
        k = load_block(k_ptr, kv_at, kv_in, dims, INTERPRETED)
        v = load_block(v_ptr, kv_at, kv_in, dims, INTERPRETED)
        s, _ = scores(q, k, scale, cap, CAP)
        keep = sees(rows[:, None], cols[None, :], lower[:, None], SEGMENTS or WINDOW)
        s = tl.where(keep, s, float("-inf"))
        if INTERPRETED:
            top = tl.reduce(s, 1, GREATEST)
        else:
            top = tl.max(s, 1)
        m_new = tl.maximum(m_i, top)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key seen yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        if INTERPRETED:
            l_i = l_i * alpha + tl.reduce(p, 1, ADD)
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # weights rounded as the eager order
        m_i = m_new
    if SINKS:
        sink = tl.load(sinks_ptr + h)
        m_end = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_end)
        l_i = l_i * alpha + tl.exp(sink - m_end)
        acc = acc * alpha[:, None]
        m_i = m_end
    l_i = tl.where(row_in, l_i, 1.0)  # the rows past the end saw nothing: no 0 / 0 (not stored)
    store_block(out_ptr, q_at, q_in, dims, acc / l_i[:, None])
    tl.store(lse_ptr + bh * n_tokens + rows, m_i + tl.log(l_i), mask=row_in)


def attention_delta(out_ptr, dout_ptr, delta_ptr, n_tokens, heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr, ADD: tl.constexpr):
    """Each query's ``dout . out`` (fp32): the term every score's gradient subtracts (the sink, whose
    value row is zero, adds nothing to it)."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = m0 + tl.arange(0, BLOCK_M)
    row_in = rows < n_tokens
    dims = tl.arange(0, BLOCK_D)
    at, inside = block_at(rows, b, h, heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
    o = load_block(out_ptr, at, inside, dims, INTERPRETED).to(tl.float32)
    do = load_block(dout_ptr, at, inside, dims, INTERPRETED).to(tl.float32)
    if INTERPRETED:
        delta = tl.reduce(o * do, 1, ADD)
    else:
        delta = tl.sum(o * do, 1)
    tl.store(delta_ptr + bh * n_tokens + rows, delta, mask=row_in)


def attention_backward_dq(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, start_ptr, dq_ptr, n_tokens, heads,
                          kv_heads, scale, cap, window, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAP: tl.constexpr, WINDOW: tl.constexpr,
                          SEGMENTS: tl.constexpr, INTERPRETED: tl.constexpr):
    """``dq`` of one block of queries of one head, over the keys the forward's block saw: the
    weights again from the scores and the saved log-sum-exp."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    g = h // (heads // kv_heads)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_in = rows < n_tokens
    dims = tl.arange(0, BLOCK_D)
    q_at, q_in = block_at(rows, b, h, heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
    q = load_block(q_ptr, q_at, q_in, dims, INTERPRETED)
    do = load_block(dout_ptr, q_at, q_in, dims, INTERPRETED)
    lse = tl.load(lse_ptr + bh * n_tokens + rows, mask=row_in, other=float("inf"))
    delta = tl.load(delta_ptr + bh * n_tokens + rows, mask=row_in, other=0.0)
    lo, lower = keys_seen(m0, rows, row_in, start_ptr, window, BLOCK_N, SEGMENTS, WINDOW)
    hi = tl.minimum(m0 + BLOCK_M, n_tokens)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_at, kv_in = block_at(cols, b, g, kv_heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
        k = load_block(k_ptr, kv_at, kv_in, dims, INTERPRETED)
        v = load_block(v_ptr, kv_at, kv_in, dims, INTERPRETED)
        s, t = scores(q, k, scale, cap, CAP)
        keep = sees(rows[:, None], cols[None, :], lower[:, None], SEGMENTS or WINDOW)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if CAP:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        ds = ds * scale
        if INTERPRETED:
            dq += tl.dot(ds, k)
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    store_block(dq_ptr, q_at, q_in, dims, dq)


def attention_backward_dkdv(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, start_ptr, end_ptr, dk_ptr, dv_ptr,
                            n_tokens, heads, kv_heads, scale, cap, window, HEAD_DIM: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            CAP: tl.constexpr, WINDOW: tl.constexpr, SEGMENTS: tl.constexpr,
                            INTERPRETED: tl.constexpr):
    """``dk`` and ``dv`` of one block of keys of one key/value head, summed over the query heads
    sharing it, over the queries that see the block: from the block's first key to the end of its
    last key's example, or the window's reach. Scores computed transposed (keys x queries)."""
    n0 = tl.program_id(0) * BLOCK_N
    bg = tl.program_id(1)
    b = bg // kv_heads
    g = bg % kv_heads
    rep = heads // kv_heads
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kv_at, kv_in = block_at(cols, b, g, kv_heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
    k = load_block(k_ptr, kv_at, kv_in, dims, INTERPRETED)
    v = load_block(v_ptr, kv_at, kv_in, dims, INTERPRETED)
    lo = n0 // BLOCK_M * BLOCK_M
    hi = n_tokens
    if SEGMENTS:
        hi = tl.load(end_ptr + tl.minimum(n0 + BLOCK_N, n_tokens) - 1)
    if WINDOW:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 + window)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    for r in range(0, rep):
        h = g * rep + r
        stats = (b * heads + h) * n_tokens
        for m0 in range(lo, hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_in = rows < n_tokens
            q_at, q_in = block_at(rows, b, h, heads, n_tokens, dims, HEAD_DIM, BLOCK_D)
            q = load_block(q_ptr, q_at, q_in, dims, INTERPRETED)
            do = load_block(dout_ptr, q_at, q_in, dims, INTERPRETED)
            lse = tl.load(lse_ptr + stats + rows, mask=row_in, other=float("inf"))
            delta = tl.load(delta_ptr + stats + rows, mask=row_in, other=0.0)
            s, t = scores(k, q, scale, cap, CAP)
            lower = earliest_keys(rows, row_in, start_ptr, window, SEGMENTS, WINDOW)
            keep = sees(rows[None, :], cols[:, None], lower[None, :], SEGMENTS or WINDOW)
            p = tl.where(keep, tl.exp(s - lse[None, :]), 0.0)
            dp = tl.dot(v, tl.trans(do))
            ds = p * (dp - delta[None, :])
            if CAP:
                ds = ds * (1.0 - t * t)
            ds = ds * scale
            if INTERPRETED:
                dv += tl.dot(p, do)
                dk += tl.dot(ds, q)
            else:
                dv += tl.dot(p.to(do.dtype), do)
                dk += tl.dot(ds.to(q.dtype), q)
    store_block(dk_ptr, kv_at, kv_in, dims, dk)
    store_block(dv_ptr, kv_at, kv_in, dims, dv)
