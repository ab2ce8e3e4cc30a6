"""Difficulty-aware prompt selection: each prompt's observed pass rate, and what a batch draws.

A group whose samples all earn the same reward teaches nothing. On a task mostly beyond the
policy (GSM8K for a 135M model) most fresh prompts give such groups; the few that split their
group are where the signal is. The pool records how every prompt's groups went and steers the
next batches by four rules:

    solved   a group whose samples all passed retires its prompt for the rest of the stage
             (``retire_solved``)
    rested   a prompt whose groups all failed ``rest_after`` times in a row sits out the next
             ``rest_iterations`` iterations
    replay   up to ``replay_share`` of each batch re-draws prompts whose last group was informative
             (some samples passed, some did not), least recently seen first
    fresh    the rest comes from the stage's seeded prompt stream, skipping solved and resting prompts

A sample passes when its total reward reaches ``pass_reward``. The state is plain JSON (one list
per prompt id), kept in the trainer's checkpointed state, so a resumed stage draws exactly the
prompts an uninterrupted one would. Every rank holds the same pool: it observes all ranks' groups.

Hand-written: verl's DAPO filter and curriculum sampler, prime-rl's difficulty pools and
open-instruct's active sampling each live inside their trainers; none is a library to import.
"""
from __future__ import annotations

from grpo_core.data.prompts import PromptStream

# one record per prompt id: [groups seen, samples passed, samples drawn, all-failed groups in a row,
#                            last iteration seen, rests until (iteration), solved (0/1), last informative (0/1)]
GROUPS, PASSED, SAMPLES, FAILS, LAST_SEEN, REST_UNTIL, SOLVED, INFORMATIVE = range(8)


class PromptPool:
    """The pool of one stage over ``stream``'s rows; ``settings``: a ``PoolSettings``."""

    def __init__(self, settings, stream: PromptStream):
        self.s, self.stream = settings, stream
        self.by_id = {r["id"]: r for r in stream.rows}
        self.records: dict[str, list] = {}

    def state_dict(self) -> dict:
        return {"pool": {k: list(v) for k, v in sorted(self.records.items())}}

    def load_state_dict(self, state: dict) -> None:
        self.records = {k: list(v) for k, v in state.get("pool", {}).items()}

    def _eligible(self, prompt_id: str, iteration: int) -> bool:
        rec = self.records.get(prompt_id)
        return rec is None or not (rec[SOLVED] or rec[REST_UNTIL] >= iteration)

    def select(self, position: int, n: int, iteration: int, exclude: set[str]) -> tuple[list[dict], int, int]:
        """``n`` rows for ``iteration``: replayed ones first, then fresh ones from the stream at
        ``position``. Returns (rows, the stream position after them, how many were replayed).
        ``exclude``: ids already drawn this iteration (dynamic sampling's extra rounds). When a
        whole pass over the stream finds nothing eligible, the stream's next rows are taken as
        they come (a small task can run out of unsolved prompts)."""
        chosen = self._replay(int(self.s.replay_share * n), iteration, exclude)
        replayed = len(chosen)
        taken = exclude | {r["id"] for r in chosen}
        scanned, size = 0, len(self.stream.rows)
        while len(chosen) < n:
            row = self.stream.take(position, 1)[0]
            position, scanned = position + 1, scanned + 1
            if scanned > size or (row["id"] not in taken and self._eligible(row["id"], iteration)):
                chosen.append(row)
                taken.add(row["id"])
        return chosen, position, replayed

    def _replay(self, k: int, iteration: int, exclude: set[str]) -> list[dict]:
        if k <= 0:
            return []
        candidates = sorted((rec[LAST_SEEN], pid) for pid, rec in self.records.items()
                            if rec[INFORMATIVE] and pid not in exclude and self._eligible(pid, iteration))
        return [self.by_id[pid] for _, pid in candidates[:k]]

    def observe(self, prompt_ids: list[str], passed: list[int], group_size: int, iteration: int) -> None:
        """Record one group per prompt id: ``passed`` of its ``group_size`` samples passed."""
        for pid, c in zip(prompt_ids, passed):
            rec = self.records.setdefault(pid, [0, 0, 0, 0, 0, -1, 0, 0])
            rec[GROUPS] += 1
            rec[PASSED] += int(c)
            rec[SAMPLES] += group_size
            rec[LAST_SEEN] = iteration
            rec[INFORMATIVE] = int(0 < c < group_size)
            rec[SOLVED] = int(bool(rec[SOLVED]) or (c == group_size and self.s.retire_solved))
            rec[FAILS] = rec[FAILS] + 1 if c == 0 else 0
            if rec[FAILS] >= self.s.rest_after:
                rec[REST_UNTIL], rec[FAILS] = iteration + self.s.rest_iterations, 0

    def counts(self, iteration: int) -> dict[str, float]:
        """The pool's state after ``iteration``: prompts seen, solved (retired), resting, and
        replayable (informative last time, eligible next iteration)."""
        seen = len(self.records)
        solved = sum(rec[SOLVED] for rec in self.records.values())
        resting = sum(1 for rec in self.records.values() if not rec[SOLVED] and rec[REST_UNTIL] > iteration)
        replayable = sum(1 for pid, rec in self.records.items()
                         if rec[INFORMATIVE] and self._eligible(pid, iteration + 1))
        return {"pool_seen": float(seen), "pool_solved": float(solved), "pool_resting": float(resting),
                "pool_replayable": float(replayable), "pool_active": float(seen - solved - resting)}

    def pass_rate(self, prompt_id: str) -> float | None:
        """The prompt's observed pass rate over all its groups (None: never drawn)."""
        rec = self.records.get(prompt_id)
        return None if rec is None else rec[PASSED] / rec[SAMPLES]
