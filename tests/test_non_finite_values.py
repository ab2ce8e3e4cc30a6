"""Non-finite values, for real: an overflowing gradient (skipped, counted, then the stage stops),
NaN in the starting weights, rewards beyond float32, sampling from a diverged distribution.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_core.train import checkpoint
from grpo_core.train.entry import main
from grpo_core.train.trainer import NonFiniteError
from tests import faulty_rewards
from tests.fault_helpers import short_stage


def test_non_finite_updates_are_skipped_then_stop_the_stage(tiny, tmp_path):
    """Rewards of 1e38 with scale='none' overflow the gradient (a real NaN, no mock).
    Call 2 alone: one skip, counted, training goes on. Calls 5-7: three in a row stop the stage."""
    faulty_rewards.reset({2, 5, 6, 7})
    args = short_stage(tiny, tmp_path, iterations=8, checkpoint=dict(keep=3), loss=dict(scale="none"),
                       rewards=[{"fn": "tests.faulty_rewards:huge_on_calls"}])
    with pytest.raises(NonFiniteError, match=r"3 non-finite updates in a row.*loss=.*grad_norm=(nan|inf).*intact"):
        main(args)
    rows = {r["iteration"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # iteration 7 raised before it was recorded
    assert rows[2]["skipped_updates"] == 1 and rows[2]["grad_norm"] != rows[2]["grad_norm"]  # nan
    assert rows[3]["skipped_updates"] == 1 and rows[3]["grad_norm"] == rows[3]["grad_norm"]  # recovered
    assert rows[6]["skipped_updates"] == 3
    assert not (tmp_path / "final").exists()
    ckpts = tmp_path / "checkpoints"
    assert checkpoint.latest_local(ckpts) == ckpts / "ckpt-000006"
    state = json.loads((ckpts / "ckpt-000006" / "state.json").read_text())
    assert state["skipped_updates"] == 3 and state["nonfinite_in_a_row"] == 2
    w4, w6 = (load_file(str(ckpts / n / "model.safetensors")) for n in ("ckpt-000004", "ckpt-000006"))
    assert all(torch.equal(w4[k], w6[k]) and torch.isfinite(w6[k]).all() for k in w4)  # skipped = untouched


def test_nan_in_the_starting_weights_is_refused_naming_the_parameter(tiny, tmp_path):
    bad = tmp_path / "nan-model"
    shutil.copytree(tiny, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"parameter model\.norm\.weight has 1 NaN/inf values"):
        main(short_stage(bad, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_rewards_beyond_float32_are_an_error_not_a_silent_inf():
    """1e39 is finite in Python but inf in the trainer's float32 reward tensor."""
    from grpo_core.data.rewards import combine_rewards

    args = (["q", "q"], ["a", "b"], {})
    with pytest.raises(ValueError, match=r"weighted reward at index 1 is 1e\+39, outside the float32 range.*rescale"):
        combine_rewards([(lambda p, c, **_: [0.0, 1e39], 1.0, "huge")], *args)
    two = [(lambda p, c, **_: [2e38, 0.0], 1.0, "a"), (lambda p, c, **_: [2e38, 0.0], 1.0, "b")]
    with pytest.raises(ValueError, match="index 0 is 4e\\+38"):  # each term fits, the sum does not
        combine_rewards(two, *args)
    assert combine_rewards([(lambda p, c, **_: [1e38, 0.0], 1.0, "big")], *args)[0] == [1e38, 0.0]


def test_sampling_from_a_diverged_policy_is_an_error_not_a_token():
    from grpo_core.rollout.decode import sample_inverse_cdf

    for row in ([float("nan"), 0.5, 0.5], [1.0, float("inf"), 0.0], [0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match="row 1 .*not a distribution.*NaN/inf"):
            sample_inverse_cdf(torch.tensor([[0.2, 0.3, 0.5], row]))
