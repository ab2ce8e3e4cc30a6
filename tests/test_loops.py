"""Loop detection: the verbatim rule by hand, against a brute-force reference, and in the decoder;
the repeats-with-changing-numbers rule by hand and against a string-search reference."""
import random
import re

import pytest
import torch

from grpo_core.evaluation.greedy import greedy_results, summarize
from grpo_core.model.loading import build_tiny
from grpo_core.rollout.decode import sample_shared_prefix
from grpo_core.rollout.generate import encode_prompts
from grpo_core.rollout.loops import (
    LoopRule,
    LoopTracker,
    RepeatRule,
    digit_token_ids,
    ending,
    looped,
    numbers_collapsed,
    repeated_share,
    repeats_itself,
)


def first_loop_end(seq: list[int], rule: LoopRule) -> int | None:
    """The rule as stated, with Python loops: the shortest prefix that ends in a tail of at least
    min_repeats periods p <= max_period and at least min_span tokens, in which every token equals
    the one p before it (a longer such tail contains a shortest one)."""
    for end in range(1, len(seq) + 1):
        for p in range(1, rule.max_period + 1):
            span = max(rule.min_repeats * p, rule.min_span)
            tail = seq[end - span:end]
            if span <= end and all(tail[i] == tail[i - p] for i in range(p, span)):
                return end
    return None


def brute_force(seq: list[int], rule: LoopRule) -> bool:
    return first_loop_end(seq, rule) is not None


def test_a_loop_is_found_at_the_token_that_completes_it():
    rule = LoopRule()  # 3 repeats, 64 tokens, periods up to 96
    two = [1, 2, 3] + [7, 8] * 38 + [9]   # period 2 from index 3: 62 equal tokens needed -> index 66
    one = [5] * 70                        # period 1 from index 0: 63 equal tokens needed -> index 63
    counting = list(range(80))            # never repeats
    tokens = torch.tensor([two, one + [0] * 10, counting])
    assert looped(tokens, torch.tensor([80, 80, 80]), rule).tolist() == [True, True, False]
    assert looped(tokens, torch.tensor([66, 63, 80]), rule).tolist() == [False, False, False]
    assert looped(tokens, torch.tensor([67, 64, 80]), rule).tolist() == [True, True, False]
    tracker, first = LoopTracker(3, rule, "cpu"), [None] * 3
    for t in range(80):
        for i, hit in enumerate(tracker.step(tokens, torch.arange(3), t).tolist()):
            first[i] = t if hit and first[i] is None else first[i]
    assert first == [66, 63, None]


def test_short_and_long_period_repeats():
    rule = LoopRule()
    legit = [4, 11] * 20 + list(range(20, 60))   # "1 + 1 + ..." 40 tokens: under the 64-token span
    sentence = list(range(100, 140))             # a 40-token sentence, twice then a third time
    two_copies = list(range(5)) + sentence * 2 + [1, 2, 3]
    three_copies = list(range(5)) + sentence * 3
    long_period = list(range(200, 300)) * 3      # period 100 > max_period: not looked for
    for seq, want in ((legit, False), (two_copies, False), (three_copies, True), (long_period, False)):
        t = torch.tensor([seq])
        assert looped(t, torch.tensor([len(seq)]), rule).item() is want
        assert brute_force(seq, rule) is want


@pytest.mark.parametrize("seed", range(4))
def test_looped_and_the_tracker_equal_a_brute_force_reference(seed):
    rule = LoopRule(min_repeats=3, min_span=12, max_period=6)  # small, so the reference stays fast
    rng = random.Random(seed)
    seqs = []
    for _ in range(24):
        seq = [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        if rng.random() < 0.7:  # plant a cycle of random period and length
            seq += [rng.randrange(4) for _ in range(rng.randrange(1, 8))] * rng.randrange(2, 9)
        seqs.append((seq + [rng.randrange(4) for _ in range(40)])[:40])
    tokens = torch.tensor(seqs)
    lengths = torch.tensor([rng.randrange(10, 41) for _ in seqs])
    want = [brute_force(s[:n], rule) for s, n in zip(seqs, lengths.tolist())]
    assert 2 <= sum(want) <= 22, "the draw must exercise both outcomes"
    assert looped(tokens, lengths, rule).tolist() == want
    # The tracker, with rows leaving the batch part-way (the decoder's compaction): a row's first
    # hit is where looped() on its prefix first says yes.
    tracker, rows, first = LoopTracker(len(seqs), rule, "cpu"), torch.arange(len(seqs)), {}
    for t in range(40):
        for r, hit in zip(rows.tolist(), tracker.step(tokens, rows, t).tolist()):
            first.setdefault(r, t) if hit else None
        if t == 25:
            keep = torch.tensor([i for i, r in enumerate(rows.tolist()) if r % 3 and r not in first])
            rows = rows[keep]
            tracker.keep(keep)
    for r, s in enumerate(seqs):
        if r in rows.tolist() or r in first:  # rows compacted away unfinished are no longer followed
            end = first_loop_end(s, rule)
            assert first.get(r) == (None if end is None else end - 1), (r, s)


def _looping_model():
    """A tiny random model whose greedy answers fall into short cycles (large random weights)."""
    torch.manual_seed(0)
    model, tok = build_tiny("llama", hidden=32, layers=2, heads=4)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval(), tok


def test_the_decoder_stops_a_looping_row_where_the_rule_first_holds():
    model, tok = _looping_model()
    ids, mask = encode_prompts(tok, ["What is 3 + 4?", "12 * 11?", "7 * 8 + 1?"], 64)
    free = sample_shared_prefix(model, ids, mask, 1, max_new_tokens=160, eos_id=-1, pad_id=0, greedy=True)
    rule = LoopRule()
    stops = [next((n for n in range(1, 161) if looped(free[i:i + 1, :n], torch.tensor([n]), rule)), None)
             for i in range(len(free))]
    assert any(stops), "the random model should loop within 160 tokens"
    early = sample_shared_prefix(model, ids, mask, 1, max_new_tokens=160, eos_id=-1, pad_id=0, greedy=True,
                                 loop_rule=rule)
    for i, n in enumerate(stops):
        end = n or 160
        assert torch.equal(early[i, :end], free[i, :end]), "the same tokens up to the stop"
        assert (early[i, end:] == 0).all(), "then padding"
    assert early.shape[1] == max(n or 160 for n in stops)


def test_greedy_results_counts_loops_apart_from_cut_answers():
    model, tok = _looping_model()
    questions = ["What is 3 + 4?", "hello"]  # the second loops
    rows = [{"id": str(i), "prompt": q, "gold": "1"} for i, q in enumerate(questions)]
    stopped = greedy_results(model, tok, rows, max_new_tokens=160)
    full = greedy_results(model, tok, rows, max_new_tokens=160, stop_loops=False)
    for a, b in zip(stopped, full):
        assert a["looped"] == b["looped"], "loops are found whether or not decoding stopped at them"
        assert not (a["looped"] and a["truncated"]), "a looped answer is not counted as cut"
        if a["looped"]:
            assert len(a["completion"]) < len(b["completion"]) and b["completion"].startswith(a["completion"])
            assert b["capped"] and not a["capped"], "stopped at the loop, not at the cap"
    assert any(a["looped"] for a in stopped)
    s = summarize(stopped)
    assert s["looped_frac"] == sum(a["looped"] for a in stopped) / 2
    assert s["truncated_frac"] == sum(a["truncated"] for a in stopped) / 2


def test_digit_tokens_of_the_tiny_tokenizer_are_its_ten_digits():
    _, tok = build_tiny("llama", hidden=32, layers=1, heads=2)
    digits = digit_token_ids(tok)
    assert sorted(tok.decode([i]) for i in digits) == list("0123456789")


def test_a_cycle_whose_numbers_change_repeats_itself():
    _, tok = build_tiny("llama", hidden=32, layers=1, heads=2)
    digits = digit_token_ids(tok)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    counting = " ".join(f"{n} students x {k} class = {n * k} students." for k, n in enumerate(range(7, 40), 2))
    assert repeats_itself(enc(counting), digits)  # numbers of 1 to 4 digits: one symbol each
    assert repeated_share(enc(counting), digits) == 1.0
    rng = random.Random(0)
    varied = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.=+") for _ in range(200)) + " the sum is 12."
    assert repeated_share(enc(varied), digits) == 0.0
    assert not repeats_itself(enc(counting[:120]), digits), "shorter than window + ngram: not judged"
    assert repeated_share(enc(counting[:120]), digits) is None
    # the same sentences with changing words where the numbers were do not repeat: only digits collapse
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))  # noqa: E731
    worded = " ".join(f"{word()} students x {word()} class = {word()} students." for _ in range(12))
    assert repeated_share(enc(worded), digits) < 0.5
    assert numbers_collapsed(enc("a 123 b 4"), digits) == numbers_collapsed(enc("a 9 b 55555"), digits)


def _reference_share(ids: list[int], digits: frozenset[int], rule: RepeatRule) -> float | None:
    """The rule restated on strings: each token one character, every digit run one 'D' (a regex),
    and an n-gram at i repeated when str.find sees it start before i."""
    text = re.sub("D+", "D", "".join("D" if t in digits else chr(0x4E00 + t) for t in ids))
    n, start = rule.ngram, len(text) - rule.window
    if start < n:
        return None
    hits = [text.find(text[i:i + n]) < i for i in range(start, len(text) - n + 1)]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("seed", range(4))
def test_repeated_share_equals_a_string_search_reference(seed):
    rule = RepeatRule(window=24, ngram=4, min_repeated=0.9)
    rng = random.Random(seed)
    digits = frozenset({0, 1, 2})
    shares = []
    for _ in range(40):
        seq = [rng.randrange(12) for _ in range(rng.randrange(0, 30))]
        if rng.random() < 0.6:  # a cycle whose digit tokens vary from copy to copy
            cycle = [rng.randrange(3, 12) for _ in range(rng.randrange(2, 8))]
            for _ in range(rng.randrange(2, 10)):
                seq += cycle + [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        want = _reference_share(seq, digits, rule)
        assert repeated_share(seq, digits, rule) == want
        assert repeats_itself(seq, digits, rule) == (want is not None and want >= 0.9)
        shares.append(want)
    assert any(s == 1.0 for s in shares) and any(s is not None and s < 0.9 for s in shares)


def test_ending_counts_a_capped_answer_that_repeats_with_new_numbers_as_looped():
    _, tok = build_tiny("llama", hidden=32, layers=1, heads=2)
    digits = digit_token_ids(tok)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    counting = enc(" ".join(f"{n} students x {k} class = {n * k} students." for k, n in enumerate(range(7, 40), 2)))
    rng = random.Random(1)
    going = enc("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.=+") for _ in range(300)))
    assert ending(counting, True, False, digits) == {"truncated": False, "looped": True, "capped": True}
    assert ending(torch.tensor(counting), True, False, digits) == ending(counting, True, False, digits)  # a row
    assert ending(going, True, False, digits) == {"truncated": True, "looped": False, "capped": True}
    # an answer that ended by itself is never truncated nor judged by the repeat rule
    assert ending(counting, False, False, digits) == {"truncated": False, "looped": False, "capped": False}
    # a verbatim loop is a loop whether the decoder stopped it or the cap did
    assert ending(going, False, True, digits) == {"truncated": False, "looped": True, "capped": False}
    assert ending(going, True, True, digits) == {"truncated": False, "looped": True, "capped": True}


@pytest.mark.parametrize("bad", [dict(ngram=0), dict(ngram=200), dict(min_repeated=0.0), dict(min_repeated=1.5)])
def test_repeat_rule_refuses_settings_it_cannot_judge_with(bad):
    with pytest.raises(ValueError, match="RepeatRule"):
        RepeatRule(**bad)
