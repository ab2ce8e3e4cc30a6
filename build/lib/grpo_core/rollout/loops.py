"""Loops in greedy completions: when an answer is already repeating itself.

A small model's greedy answer often falls into a cycle ("She has 5 apples. She has 5 apples.
...") that it keeps repeating until the generation cap. Under greedy decoding such a cycle almost
never ends by itself, so every extra token spends time without changing the answer. An
evaluation therefore stops a row once its tail is a verbatim loop, and reports it as *looped*,
apart from the answers the cap *cut* while they were still going somewhere: only the second
share says whether the cap is too small.

The rule (``LoopRule``): the last ``span`` tokens repeat with a period ``p <= max_period``
(token t equals token t - p throughout) at least ``min_repeats`` times, and ``span >=
min_span``. With the defaults a period-1 loop needs 64 identical tokens and a 40-token sentence
needs 3 copies (120 tokens): legitimate answers that repeat a short pattern ("1 + 1 + 1") a few
times are not loops.

``looped`` applies the rule to finished completions; ``LoopTracker`` applies the same rule
incrementally, one decode step at a time, so a decoder can stop a row at the first token where
``looped`` would say yes. Both are pure tensor functions.

Some loops change their numbers as they go ("7944 students x 5 class = 4348 students. 4348
students x 6 class = ..."), so no verbatim rule sees them. ``repeats_itself`` (``RepeatRule``)
catches those, but only in answers the cap cut off: with every run of digit tokens read as one
symbol, nearly all n-grams in the answer's last ``window`` symbols already occurred earlier in it.
It needs ``window + ngram`` symbols (136 by default), so it never applies under a shorter cap. It
is not used to stop decoding early: a repetitive answer sometimes still ends by itself, so only
the cap may end one. What it decides is how a capped answer is counted (``ending``): as a loop,
or as cut while still going somewhere (the share that says whether the cap is too small).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoopRule:
    """When a completion's tail counts as a verbatim loop (see the module docstring)."""

    min_repeats: int = 3
    min_span: int = 64
    max_period: int = 96

    def periods(self, device=None) -> torch.Tensor:
        return torch.arange(1, self.max_period + 1, device=device)                # [K]

    def needed_runs(self, device=None) -> torch.Tensor:
        """Per period p, how many consecutive tokens must equal the token p before them: the
        looped tail is that run plus one period."""
        p = self.periods(device)
        return torch.maximum((self.min_repeats - 1) * p, self.min_span - p)       # [K]


def looped(tokens: torch.Tensor, lengths: torch.Tensor, rule: LoopRule = LoopRule()) -> torch.Tensor:
    """Rows of ``tokens`` [B, T] whose first ``lengths`` [B] tokens (the answer before its stop
    token) end in, or pass through, a verbatim loop: bool [B]. "Pass through" matters for a
    decoder that stopped the row there (``LoopTracker``): the rule held at its last token."""
    B, T = tokens.shape
    out = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    pos = torch.arange(T, device=tokens.device)                                   # [T]
    inside = pos[None] < lengths[:, None]                                         # [B, T]
    for p, need in zip(rule.periods().tolist(), rule.needed_runs().tolist()):
        if p >= T:
            break
        eq = torch.zeros_like(inside)
        eq[:, p:] = (tokens[:, p:] == tokens[:, :-p]) & inside[:, p:]             # [B, T]
        last_break = torch.where(~eq, pos, -1).cummax(-1).values                  # [B, T]
        out |= ((pos - last_break) >= need).any(-1)
    return out


class LoopTracker:
    """``looped``'s rule one step at a time: per row and period, the run of tokens equal to the
    token one period back. ``step`` costs a few [b, max_period] tensor ops, negligible beside a
    decode step's forward."""

    def __init__(self, rows: int, rule: LoopRule, device):
        self.periods = rule.periods(device)                                       # [K]
        self.need = rule.needed_runs(device)                                      # [K]
        self.runs = torch.zeros(rows, len(self.periods), dtype=torch.long, device=device)  # [B, K]

    def step(self, tokens: torch.Tensor, rows: torch.Tensor, t: int) -> torch.Tensor:
        """``tokens`` [B, T] holds every row's tokens up to step ``t`` (this step's included);
        ``rows`` [b] are the rows still decoded (this tracker's rows, in order). Returns bool [b]:
        the rule holds at step t."""
        back = t - self.periods                                                   # [K]
        prev = tokens[rows[:, None], back.clamp(min=0)[None]]                     # [b, K]
        eq = (prev == tokens[rows, t][:, None]) & (back >= 0)[None]
        self.runs = (self.runs + 1) * eq
        return (self.runs >= self.need).any(-1)

    def keep(self, keep: torch.Tensor) -> None:
        """Follow the decoder's compaction: keep only rows ``keep`` [b']."""
        self.runs = self.runs[keep]


@dataclass(frozen=True)
class RepeatRule:
    """When an answer cut off by the cap repeats itself with changing numbers (module docstring):
    at least ``min_repeated`` of the ``ngram``-grams lying within its last ``window`` symbols
    (digit runs collapsed) also occur at an earlier start in the collapsed answer."""

    window: int = 128
    ngram: int = 8
    min_repeated: float = 0.9

    def __post_init__(self):
        if not 1 <= self.ngram <= self.window:
            raise ValueError(f"RepeatRule: need 1 <= ngram <= window, got ngram={self.ngram}, window={self.window}")
        if not 0.0 < self.min_repeated <= 1.0:
            raise ValueError(f"RepeatRule: min_repeated must be in (0, 1], got {self.min_repeated}")


DIGITS = "0123456789"
NUMBER = -1  # the symbol a run of digit tokens collapses to


@functools.lru_cache(maxsize=4)
def digit_token_ids(tok) -> frozenset[int]:
    """The ids of ``tok``'s vocabulary whose text, stripped of surrounding space, is ASCII digits.
    With a vocabulary of space-prefixed number tokens ("Ġ12"), "12 34" is then one run, one
    ``NUMBER``. Cached per tokenizer object (tokenizers compare by identity): a tokenizer whose
    vocabulary grows afterwards needs ``digit_token_ids.cache_clear()``."""
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    return frozenset(i for i, t in enumerate(texts) if t.strip() and all(c in DIGITS for c in t.strip()))


def numbers_collapsed(ids: Sequence[int], digit_ids: frozenset[int]) -> list[int]:
    """``ids`` with every run of digit tokens replaced by one ``NUMBER``: "19993" and "10" compare
    equal whatever their length in tokens."""
    out: list[int] = []
    for t in ids:
        if t in digit_ids:
            if out and out[-1] == NUMBER:
                continue
            t = NUMBER
        out.append(t)
    return out


def repeated_share(ids: Sequence[int], digit_ids: frozenset[int], rule: RepeatRule = RepeatRule()) -> float | None:
    """The share of the n-grams lying within the last ``rule.window`` collapsed symbols that also
    start earlier in the collapsed sequence; None when it is shorter than ``window + ngram``
    symbols, too short to judge."""
    seq = numbers_collapsed(ids, digit_ids)
    n, start = rule.ngram, len(seq) - rule.window
    if start < n:
        return None
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(seq) - n + 1):
        gram = tuple(seq[i:i + n])
        repeated += i >= start and gram in seen
        seen.add(gram)
    return repeated / (len(seq) - n + 1 - start)


def repeats_itself(ids: Sequence[int], digit_ids: frozenset[int], rule: RepeatRule = RepeatRule()) -> bool:
    """True when ``ids`` (an answer's tokens) is long enough to judge and its tail repeats earlier
    text with only numbers changed (``RepeatRule``)."""
    share = repeated_share(ids, digit_ids, rule)
    return share is not None and share >= rule.min_repeated


def ending(ids: Sequence[int] | torch.Tensor, capped: bool, verbatim: bool, digit_ids: frozenset[int],
           rule: RepeatRule = RepeatRule()) -> dict[str, bool]:
    """How one greedy answer (``ids``: its tokens before any stop token, a list or a 1-D tensor)
    ended. ``capped``: decoding reached the generation cap; ``verbatim``: ``looped`` holds for it.
    Returns ``looped`` (a verbatim loop, or capped while it repeats itself with changing numbers),
    ``truncated`` (capped while not looping: what says a cap is too small) and ``capped`` as given.
    The tokens are read only for a capped answer that is not a verbatim loop."""
    if capped and not verbatim and isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    loop = verbatim or (capped and repeats_itself(ids, digit_ids, rule))
    return {"truncated": capped and not loop, "looped": loop, "capped": capped}
