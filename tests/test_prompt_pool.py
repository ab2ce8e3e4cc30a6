"""The prompt pool's rules on fixed outcomes, and a stage that selects through it resumes bitwise."""
import json

import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.groups import PoolSettings
from grpo_core.config.stage import GRPOConfig
from grpo_core.data.pool import PromptPool
from grpo_core.data.prompts import PromptStream
from grpo_core.train.entry import main
from tests.faults import InjectedFault, crash_after_iteration
from tests.helpers import SEVENS, same_weights, stage_args

G = 4


def _pool(n_rows=20, **settings):
    rows = [{"id": f"p{i}", "prompt": f"q{i}", "gold": "1"} for i in range(n_rows)]
    return PromptPool(PoolSettings(enabled=True, **settings), PromptStream(rows, seed=3))


def _ids(rows):
    return [r["id"] for r in rows]


def test_without_outcomes_the_pool_draws_the_stream_in_order():
    pool = _pool()
    rows, position, replayed = pool.select(0, 5, iteration=1, exclude=set())
    assert _ids(rows) == _ids(pool.stream.take(0, 5)) and position == 5 and replayed == 0


def test_a_solved_prompt_retires_and_is_skipped_by_later_draws():
    pool = _pool(n_rows=6)
    first = _ids(pool.stream.take(0, 6))
    pool.observe(first[:1], [G], G, iteration=1)                  # all 4 samples passed
    rows, position, _ = pool.select(6, 6, iteration=2, exclude=set())  # the second epoch
    assert first[0] not in _ids(rows) and len(rows) == 6
    assert pool.counts(2)["pool_solved"] == 1


def test_retire_solved_off_keeps_a_solved_prompt():
    pool = _pool(n_rows=6, retire_solved=False)
    first = _ids(pool.stream.take(0, 6))
    pool.observe(first[:1], [G], G, iteration=1)
    assert first[0] in _ids(pool.select(6, 6, iteration=2, exclude=set())[0])


def test_a_prompt_failed_rest_after_times_rests_rest_iterations_then_returns():
    pool = _pool(n_rows=4, rest_after=2, rest_iterations=3)
    pid = _ids(pool.stream.take(0, 1))[0]
    pool.observe([pid], [0], G, iteration=1)
    assert pool._eligible(pid, 2)                                  # one failure: not yet
    pool.observe([pid], [0], G, iteration=2)                       # the second in a row: rests 3 iterations
    assert [pool._eligible(pid, it) for it in (3, 4, 5, 6)] == [False, False, False, True]
    assert pool.counts(2)["pool_resting"] == 1 and pool.counts(5)["pool_resting"] == 0


def test_a_pass_between_failures_resets_the_count():
    pool = _pool(n_rows=4, rest_after=2)
    pid = _ids(pool.stream.take(0, 1))[0]
    for it, passed in enumerate([0, 1, 0], start=1):
        pool.observe([pid], [passed], G, iteration=it)
    assert pool._eligible(pid, 4)
    assert pool.pass_rate(pid) == pytest.approx(1 / 12)


def test_replay_takes_informative_prompts_least_recently_seen_first_then_fresh_ones():
    pool = _pool(replay_share=0.5)
    pool.observe(["p3", "p7", "p9"], [1, 2, 0], G, iteration=1)   # p3, p7 informative; p9 all wrong (rests)
    pool.observe(["p5"], [3], G, iteration=2)                     # informative, seen later
    rows, position, replayed = pool.select(0, 4, iteration=3, exclude=set())
    assert replayed == 2 and _ids(rows)[:2] == ["p3", "p7"]       # iteration 1 before iteration 2, then by id
    fresh = [r for r in pool.stream.take(0, 20) if r["id"] not in {"p3", "p7", "p9"}][:2]
    assert _ids(rows)[2:] == _ids(fresh)
    rows, _, replayed = pool.select(position, 4, iteration=3, exclude=set(_ids(rows)))  # a dynamic-sampling round
    assert replayed == 1 and _ids(rows)[0] == "p5"


def test_when_nothing_is_eligible_the_stream_is_taken_as_it_comes():
    pool = _pool(n_rows=3)
    pool.observe(["p0", "p1", "p2"], [G, G, G], G, iteration=1)
    rows, _, _ = pool.select(0, 2, iteration=2, exclude=set())
    assert len(rows) == 2 and len(set(_ids(rows))) == 2


def test_the_state_round_trips_through_json_and_selects_the_same():
    pool = _pool(replay_share=0.5, rest_iterations=2)
    pool.observe(["p1", "p2", "p4", "p6"], [0, 2, 4, 1], G, iteration=1)
    again = _pool(replay_share=0.5, rest_iterations=2)
    again.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert again.select(4, 6, 2, set()) == pool.select(4, 6, 2, set())
    assert again.counts(1) == pool.counts(1) == {"pool_seen": 4.0, "pool_solved": 1.0, "pool_resting": 1.0,
                                                 "pool_replayable": 2.0, "pool_active": 2.0}


@pytest.mark.parametrize("field, value, match", [("replay_share", 1.5, r"pool\.replay_share"),
                                                  ("rest_after", 0, r"pool\.rest_after"),
                                                  ("rest_iterations", 0, r"pool\.rest_iterations")])
def test_bad_pool_settings_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(pool={field: value})


def _pooled_stage(tiny, out):
    return stage_args(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=6,
                      optim=dict(lr=3e-3), loss=dict(beta=0.04), prompts_per_iter=4,
                      sampling=dict(group_size=4, max_new_tokens=12), checkpoint=dict(every=2),
                      pool=dict(enabled=True, pass_reward=0.15, replay_share=0.5, rest_iterations=2))


def _metrics(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_pooled_stage_logs_the_pool_and_resumes_bitwise(tiny, tmp_path):
    main(_pooled_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(3), pytest.raises(InjectedFault):
        main(_pooled_stage(tiny, tmp_path / "crashed"))
    main(_pooled_stage(tiny, tmp_path / "crashed"))
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")
    pool_keys = ("pool_seen", "pool_solved", "pool_resting", "pool_replayable", "pool_active", "pool_replayed")
    straight, crashed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "crashed")
    assert [[r[k] for k in pool_keys] for r in straight] == [[r[k] for k in pool_keys] for r in crashed]
    assert sum(r["pool_replayed"] for r in straight) > 0            # the rules did act in this run
    state = lambda out: json.loads(max((out / "checkpoints").iterdir()).joinpath("state.json").read_text())  # noqa
    assert state(tmp_path / "straight")["pool"] == state(tmp_path / "crashed")["pool"]
