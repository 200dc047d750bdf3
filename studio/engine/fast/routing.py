"""What a sparse layer's routing leaves behind (engine/fast/moe.py routes): the micro-batch's token
counts per expert and the load-balancing loss' probabilities (:class:`RouterLog`), and the routing
a checkpointed forward keeps for its recomputation (:class:`KeptRouting`)."""

from __future__ import annotations

import torch


class RouterLog:
    """The sparse layers' routing of the micro-batch going through the model, in tensors that
    stay where they are, so that a CUDA graph's replay of the forward writes them as an eager
    forward does: each layer writes its experts' token counts into its row of :attr:`counts`, and
    the model reads them once the stack has run (:meth:`tally`), outside any graph.

    A layer recomputed for its backward reuses its forward's routing (:class:`KeptRouting`) and
    records nothing."""

    def __init__(self, experts: int, top_k: int, balance: bool, layers: int = 0, device: torch.device | None = None):
        self.experts = experts
        self.top_k = top_k
        self.balance = balance
        """The layers record their probabilities for :meth:`balance_loss` (eager steps only:
        core/plan.py's ``moe_graphs_off``)."""
        self.counts = torch.zeros(layers, experts, dtype=torch.long, device=device)
        """Token copies each expert took in the last forward ``[layers, experts]``, a row a layer
        (a dense layer's stays zero)."""
        self.real_copies = torch.zeros((), dtype=torch.long, device=device)
        """How many of the stream's first token copies (``top_k`` a token, token by token) are
        real (:meth:`begin`): a CUDA-graph layout's padding tokens after them are routed too, and
        counted nowhere."""
        self.tokens = torch.zeros(experts, dtype=torch.long, device=device)
        """Token copies each expert took, summed over the sparse layers, since :meth:`take_tokens`."""
        self.probs: dict[int, torch.Tensor] = {}
        """Each layer's router probabilities summed over its tokens ``[experts]`` (fp32, with their
        gradient), by layer, where :attr:`balance` is on."""
        self.rows = 0
        """Tokens each layer routed in the last forward (for :meth:`balance_loss`)."""

    def begin(self, real: int) -> None:
        """A new forward whose first ``real`` tokens are real (a device write, no host sync)."""
        self.probs = {}
        self.real_copies.fill_(real * self.top_k)

    def record(self, index: int, experts: torch.Tensor, probs: torch.Tensor | None, rows: int) -> None:
        """Layer ``index``'s routing: ``experts``, each token copy's expert (``[rows x top_k]``,
        int64, token by token), counted per expert for the real tokens; where the balance loss is
        on, the router's probabilities summed over the tokens."""
        real = (torch.arange(experts.shape[0], device=experts.device) < self.real_copies).long()
        self.counts[index].zero_().scatter_add_(0, experts, real)
        self.rows = rows
        if probs is not None:
            self.probs[index] = probs

    def tally(self) -> None:
        """Add the last forward's counts to :attr:`tokens` (device operations only)."""
        self.tokens.add_(self.counts.sum(0))

    def take_tokens(self) -> list[int]:
        """The counts since the last call (a step's), and start counting anew: one host read a step."""
        tokens = self.tokens.tolist()
        self.tokens.zero_()
        return tokens

    def balance_loss(self) -> torch.Tensor | None:
        """transformers' ``load_balancing_loss_func`` over this micro-batch's sparse layers: the
        experts' share of the token copies times their mean router probability, summed, times the
        number of experts; both shares are pooled over every layer first, as transformers does.
        None when nothing was recorded."""
        if not self.probs:
            return None
        layers = list(self.probs)
        rows = self.rows * len(layers)
        counts = self.counts[layers].sum(0).float()
        probs = torch.stack([self.probs[i] for i in layers]).sum(0)
        return (counts / rows * probs / rows).sum() * self.experts


def key_dtype(experts: int) -> torch.dtype:
    """The narrowest integer type that holds an expert's index: the sort by expert is a radix sort
    whose passes go one byte of the key at a time (one pass for up to 256 experts, against eight
    for the int64 indices top-k gives)."""
    return torch.uint8 if experts <= 256 else torch.int16 if experts <= 2 ** 15 else torch.int32


class KeptRouting:
    """What a checkpointed layer's forward keeps of its routing for that layer's recomputation in
    the backward: each token copy's expert and the copies' order sorted by expert, and where each
    expert's rows end (``top_k x 5`` bytes a token for up to 256 experts, ``top_k x 6`` beyond).
    They follow from the layer's input alone, so the recomputation takes them instead of running
    the router's top-k and the sort again; it still runs the router's product and the routing
    weights under autograd, whose backward the router's input and the balance loss need.

    One a layer and forward (engine/fast/model.py's ``stack``): the forward :meth:`keep` s, its
    recomputation :meth:`take` s, after which a recomputation (a second backward) sorts anew."""

    def __init__(self) -> None:
        self._kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def held(self) -> bool:
        """Whether a forward's routing waits here."""
        return self._kept is not None

    def keep(self, keys: torch.Tensor, order: torch.Tensor, offs: torch.Tensor) -> None:
        """The forward's routing: ``keys`` each copy's expert (:func:`key_dtype`), ``order`` the
        copies sorted by expert (int32), ``offs`` each expert's rows' end (int32)."""
        self._kept = (keys, order, offs)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :meth:`keep` was given, let go of here."""
        kept, self._kept = self._kept, None
        assert kept is not None, "no routing kept"
        return kept
