"""The torchrun command a training step runs: one node, or one node of a multi-node gang.
(The real gang runs in tests/test_flow.py::test_a_two_node_gang_trains_the_weights_one_node_does.)"""
import pytest

from grpo_core.pipeline.launcher import Gang, first_node, torchrun_command


def _flags(cmd: list[str]) -> dict:
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in cmd if a.startswith("--"))


def test_one_node_runs_standalone():
    flags = _flags(torchrun_command("stage.json", 4))
    assert "--standalone" in flags and flags["--nproc_per_node"] == "4"
    assert not {"--nnodes", "--node_rank", "--rdzv-endpoint"} & set(flags)


def test_a_gang_node_meets_the_others_at_node_0_with_a_fixed_rank_order():
    """Static rendezvous: global rank = node_rank x nproc + local rank, as in one node's run
    (c10d would order nodes by arrival, and rank 0 might not be on node 0)."""
    gang = Gang(nodes=3, node_index=2, main_ip="10.0.0.5", port=29411, rdzv_id="run-7-gsm8k_grpo")
    flags = _flags(torchrun_command("stage.json", 4, gang))
    assert "--standalone" not in flags
    assert flags == {"--nnodes": "3", "--node_rank": "2", "--rdzv-backend": "static",
                     "--rdzv-endpoint": "10.0.0.5:29411", "--rdzv-id": "run-7-gsm8k_grpo",
                     "--nproc_per_node": "4", "--config": ""}
    assert not gang.leads and Gang(nodes=3, node_index=0).leads


def test_the_join_keeps_the_summary_of_the_node_that_holds_rank_0():
    assert first_node([{"node_index": 1}, {"model_uri": "s3://b/final"}, {"node_index": 2}]) == {"model_uri": "s3://b/final"}
    with pytest.raises(RuntimeError, match="exactly one stage summary among the gang's 2 tasks, got 0"):
        first_node([{"node_index": 1}, {"node_index": 2}])
