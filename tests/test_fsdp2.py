"""FSDP2 sharding (``parallelism = "fsdp2"``) under real torchrun with 2 gloo ranks: the update
equals DDP's and one process's, each rank holds half the parameters and AdamW state, a killed
run resumes from its sharded checkpoint to the uninterrupted weights, the final model is a plain
HF dir, and the settings it cannot run with are refused by name."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig, deep_merge
from grpo_core.config.stage import GRPOConfig
from grpo_core.io import storage
from grpo_core.train import checkpoint
from tests.fault_helpers import finish_torchrun, logged_iterations, start_torchrun, torchrun_worker, wait_for_iteration
from tests.helpers import same_weights
from tests.trainer_helpers import ddp_update

FSDP2 = {"execution": {"parallelism": "fsdp2"}}


def test_fsdp2_update_equals_ddp_and_one_process_with_half_the_memory_per_rank(tiny, tmp_path):
    one, one_calls = ddp_update(tiny, tmp_path / "one.st", 1, "dapo")
    ddp, _ = ddp_update(tiny, tmp_path / "ddp.st", 2, "dapo")
    fsdp, fsdp_calls = ddp_update(tiny, tmp_path / "fsdp.st", 2, "dapo", **FSDP2)
    # one process: shared-prefix scoring of the reference and the policy; fsdp2: the reference
    # (on gathered weights) only, FSDP's root scores with one full forward
    assert (one_calls, fsdp_calls) == (2, 1)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4  # a real gradient
    assert one.keys() == fsdp.keys() == ddp.keys()
    for k in one:
        assert torch.allclose(fsdp[k], ddp[k], atol=1e-7, rtol=1e-5), k
        assert torch.allclose(fsdp[k], one[k], atol=1e-7, rtol=1e-4), k
    held = {side: json.loads((tmp_path / f"{side}.st.bytes.json").read_text()) for side in ("ddp", "fsdp")}
    for part in ("params", "grads", "optimizer"):  # rank 0's bytes: about half (layers split by rows)
        assert held["ddp"][part] > 0 and 0.45 <= held["fsdp"][part] / held["ddp"][part] <= 0.55, (part, held)


def test_fsdp2_micro_batches_and_bf16_follow_the_full_batch_update(tiny, tmp_path):
    """Micro-batches (reduce-scatter after each backward, summed in the shards) give the same
    gradient; bf16 through FSDP's mixed-precision policy gives nearly the same direction."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, "dapo")
    micro, _ = ddp_update(tiny, tmp_path / "micro.st", 2, "dapo", micro_batch_groups=1, **FSDP2)
    bf16, _ = ddp_update(tiny, tmp_path / "bf16.st", 2, "dapo", execution={"parallelism": "fsdp2", "precision": "bf16"})
    for k in one:
        assert torch.allclose(micro[k], one[k], atol=1e-7, rtol=1e-4), k
    flat = lambda g: torch.cat([g[k].flatten().double() for k in sorted(one)])  # noqa: E731
    cos = torch.nn.functional.cosine_similarity(flat(one), flat(bf16), dim=0).item()
    assert 0.99 < cos < 1.0, cos  # bf16 matmuls: close, and not silently fp32


def test_fsdp2_ranks_with_different_numbers_of_micro_batches_equal_one_process(tiny, tmp_path):
    """Dynamic sampling can leave ranks with different numbers of groups: here 1 and 3, scored
    one group per micro-batch. Each FSDP layer call is a collective, so rank 0 runs two
    zero-weighted micro-batches to match rank 1 (without them the ranks' all-gathers mismatch)."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, "grpo", groups=4)
    two, _ = ddp_update(tiny, tmp_path / "two.st", 2, "grpo", groups=4, rank0_groups=1, micro_batch_groups=1, **FSDP2)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


def test_fsdp2_killed_run_resumes_from_its_sharded_checkpoint_to_the_uninterrupted_weights(tiny, tmp_path):
    kw = dict(iterations=6, checkpoint=dict(every=2, keep=2), loss=dict(beta=0.04), validation=dict(every=3, size=4),
              **FSDP2)
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    log = tmp_path / "killed.log"
    proc = start_torchrun(tiny, killed, log, **kw)
    wait_for_iteration(proc, killed, log, 3)
    os.kill(torchrun_worker(proc.pid, rank=1).pid, signal.SIGKILL)  # a rank that writes only its shards
    assert finish_torchrun(proc, log) != 0
    assert not (killed / "final").exists(), "kill came too late"
    last = checkpoint.latest_local(killed / "checkpoints")
    assert last is not None and checkpoint.iteration_of(last.name) >= 2
    names = {p.name for p in last.iterdir()}
    assert {checkpoint.SHARDED, "__0_0.distcp", "__1_0.distcp"} <= names and not names & checkpoint.WEIGHTS

    rerun = start_torchrun(tiny, killed, log, **kw)
    assert finish_torchrun(rerun, log) == 0, log.read_text()[-3000:]
    straight_proc = start_torchrun(tiny, straight, tmp_path / "straight.log", **kw)
    assert finish_torchrun(straight_proc, tmp_path / "straight.log") == 0, \
        (tmp_path / "straight.log").read_text()[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from_iteration"] == checkpoint.iteration_of(last.name) and summary["iterations_run"] == 6
    assert logged_iterations(killed) == list(range(1, 7))
    rows = [json.loads(ln) for ln in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "eval_accuracy" in r] == [3, 6]  # evaluation on gathered weights
    assert json.loads((straight / "objective.json").read_text())["parallelism"].startswith("fsdp2: ")
    assert same_weights(killed / "final", straight / "final")
    # the final model: gathered into a plain HF dir (full shapes, the model's own names), loadable
    from transformers import AutoModelForCausalLM

    final, start = load_file(str(straight / "final" / "model.safetensors")), load_file(str(tiny / "model.safetensors"))
    assert final.keys() == start.keys() and all(final[k].shape == start[k].shape for k in start)
    assert any(not torch.equal(final[k], start[k]) for k in start)  # trained
    assert AutoModelForCausalLM.from_pretrained(straight / "final").num_parameters() > 0


def test_a_sharded_checkpoint_is_not_loaded_as_a_ddp_one(tiny, tmp_path):
    """A complete (checksummed) fsdp2 checkpoint met by a one-process ddp stage: an error that
    names both settings, before anything is overwritten."""
    from grpo_core.train.entry import main
    from tests.helpers import SEVENS, stage_args

    ckpt = tmp_path / "checkpoints" / "ckpt-000002"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.SHARDED).write_bytes(b"index")
    for name in checkpoint.REQUIRED:
        (ckpt / name).write_bytes(b"x")
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(
        {p.name: {"size": p.stat().st_size, "sha256": storage.sha256_file(p)} for p in ckpt.iterdir()}))
    with pytest.raises(ValueError, match=r"parallelism = 'fsdp2'.*Resume with parallelism = 'fsdp2'"):
        main(stage_args(runtime=dict(model=str(tiny), output_dir=str(tmp_path)), rewards=SEVENS, iterations=3,
                        prompts_per_iter=2, sampling=dict(group_size=2, max_new_tokens=4)))


@pytest.mark.parametrize("fields,match", [
    ({"lora": {"rank": 4}}, r"stage 'curriculum'\.execution\.parallelism: 'fsdp2' with LoRA"),
    ({"execution": {"compile_scoring": True}},
     r"stage 'curriculum'\.execution\.parallelism: 'fsdp2' with compile_scoring"),
    ({"execution": {"parallelism": "zero3"}}, r"stage 'curriculum'\.execution\.parallelism"),
])
def test_settings_fsdp2_cannot_run_with_are_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(runtime=dict(stage="curriculum"), **deep_merge(FSDP2, fields))


def test_fsdp2_on_one_rank_is_refused_in_the_config_and_in_the_stage(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"curriculum\.execution\.parallelism: 'fsdp2' shards.*nproc_per_node = 1"):
        PipelineConfig.from_dict({"curriculum": FSDP2, "compute": {"nproc_per_node": 1}})
    PipelineConfig.from_dict({"curriculum": FSDP2, "compute": {"nproc_per_node": 2}})  # accepted
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    cfg = GRPOConfig(runtime=dict(model=str(tiny), output_dir=str(tmp_path)), **FSDP2)
    with pytest.raises(ConfigError, match=r"parallelism: 'fsdp2' shards over ranks.*torchrun --nproc_per_node >= 2"):
        Trainer(cfg, dist.init())
