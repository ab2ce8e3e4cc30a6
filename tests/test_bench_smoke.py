"""Smoke tests of the benchmark and GPU-check code paths (tiny configs, CPU; no timing is asserted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_grpo
import gpu_check
import lockstep

REPO = Path(__file__).resolve().parents[1]


def test_summary_and_paired_ratios_from_synthetic_runs():
    rows = [{"total": t, "cpu": t, "generate": t / 2, "reward": 0.0, "ref_old_logp": 0.1, "fwd_bwd_step": 0.2,
             "tokens": 100.0, "completions": 4} for t in (9.0, 1.0, 2.0, 3.0)]
    s = bench_grpo.summarize(rows, warmup=1)
    assert s["s_per_iter"] == 2.0 and s["iters_measured"] == 3 and s["mean_completion_len"] == 25.0
    runs = {"ours": [dict(s, peak_rss_mb=100.0)], "trl": [dict(s, s_per_iter=4.0, peak_rss_mb=200.0)]}
    out = lockstep.compare(runs)
    assert out["ours"]["ratio_vs_trl"] == 0.5 and out["ours"]["rss_ratio_vs_trl"] == 0.5
    assert "ratio_vs_trl" not in out["trl"]
    # iteration pairs: ours (1, 2, 3) against TRL (1, 2, 3) x (4, 1, 0.5) after the warm-up one
    trl = dict(s, all_s_per_iter=[9.0, 4.0, 2.0, 1.5], peak_rss_mb=200.0)
    out = lockstep.compare({"ours": [dict(s, peak_rss_mb=100.0)], "trl": [trl]})
    assert out["ours"]["ratio_vs_trl_iter_pairs_median"] == 1.0  # median of 0.25, 1.0, 2.0


def test_sides_run_in_lockstep(tmp_path):
    """Two workers, one iteration at a time: no two iterations overlap, and the order is A B B A A B."""
    import os

    before = os.sched_getaffinity(0)
    report = bench_grpo.main(["--configs", "quick", "--sides", "ours,ours-score", "--iters", "2", "--warmup", "1",
                              "--repeats", "1", "--out-dir", str(tmp_path)])
    assert os.sched_getaffinity(0) == before  # the parent's own pinning is undone
    assert report["worker_cpus"] == str(max(before))  # every side on the same CPU (1 thread)
    runs = report["configs"]["quick"]["runs"]
    spans = sorted((t0, t1, side) for side in runs for t0, t1 in runs[side][0]["iter_wall"])
    assert len(spans) == 6 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert [side for *_, side in spans] == ["ours", "ours-score", "ours-score", "ours", "ours", "ours-score"]
    # no worker wraps up (summary, exit) while another side's last iteration runs on the shared CPU
    assert min(runs[side][0]["released_at"] for side in runs) >= spans[-1][1]
    assert report["configs"]["quick"]["same_prompts"] is True  # same seed: the same prompts each iteration


def test_same_prompts_compares_every_iteration_of_every_run():
    digest = lockstep.prompts_digest
    a, b = digest(["q1", "q2", "q1"]), digest(["q2", "q1"])
    assert a == b != digest(["q1", "q3"])  # order-free, and repeats (the G copies) do not count
    run = lambda *d: {"prompt_digests": list(d)}  # noqa: E731
    assert lockstep.same_prompts({"ours": [run(a, "x")], "trl": [run(b, "x")]}) is True
    assert lockstep.same_prompts({"ours": [run(a, "x")], "trl": [run(a, "y")]}) is False
    assert lockstep.same_prompts({"ours": [run(a, "x")], "trl": [run(a, None)]}) is None


@pytest.mark.parametrize("name,parsed", [("ours", ("ours", [], False, None)), ("trl", ("trl", [], False, None)),
                                         ("ours-score-chunks", ("ours", ["score", "chunks"], False, None)),
                                         ("ours+compile", ("ours", [], True, None)),
                                         ("trl+compile", ("trl", [], True, None)),
                                         ("ours+bf16", ("ours", [], False, "bf16")),
                                         ("ours+autocast", ("ours", [], False, "autocast")),
                                         ("ours-pack+compile+bf16", ("ours", ["pack"], True, "bf16"))])
def test_side_names_parse(name, parsed):
    assert bench_grpo.parse_side(name) == parsed


@pytest.mark.parametrize("name", ["ours-fast", "trl-score", "ours+jit", "tlr", "ours+", "trl+bf16",
                                  "ours+bf16+bf16",
                                  "ours+bf16+autocast", "trl+autocast"])
def test_bad_side_names_fail_before_any_worker_starts(name):
    with pytest.raises(SystemExit, match="side"):
        bench_grpo.main(["--configs", "quick", "--sides", f"ours,{name}"])


def test_our_side_runs_the_trainer_iteration(tmp_path):
    spec = bench_grpo.CONFIGS["quick"]
    model_dir = bench_grpo.build_model_dir(spec, tmp_path / "m")
    rows = bench_grpo.run_ours(spec, str(model_dir), iters=1, warmup=1)
    assert len(rows) == 2
    assert rows[-1]["completions"] == spec["prompts"] * spec["group_size"]
    assert 0 < rows[-1]["tokens"] <= rows[-1]["completions"] * spec["max_new_tokens"]


def test_trl_side_runs_the_same_config(tmp_path):
    try:
        import trl  # noqa: F401
    except ImportError:
        pytest.fail("the TRL side needs trl: pip install -r requirements-bench.txt (.ci/run does)", pytrace=False)
    from trl_runner import run_trl

    spec = bench_grpo.CONFIGS["quick"]
    model_dir = bench_grpo.build_model_dir(spec, tmp_path / "m")
    rows = run_trl(spec, bench_grpo.COMMON, bench_grpo.REWARD_FN, str(model_dir), iters=1, warmup=1)
    assert len(rows) == 2 and rows[0]["completions"] == spec["prompts"] * spec["group_size"]
    assert rows[0]["generate"] > 0 and rows[0]["ref_old_logp"] > 0  # beta > 0: the reference forward ran
    ours = bench_grpo.run_ours(spec, str(model_dir), iters=1, warmup=1)
    assert [r["prompts"] for r in rows] == [r["prompts"] for r in ours]  # the same prompts, step by step
    # micro-batched by one group (the larger real-model configs): one generation and one optimizer
    # step per step still, over the same prompts
    micro = run_trl(dict(spec, trl_micro_batch=spec["group_size"]), bench_grpo.COMMON, bench_grpo.REWARD_FN,
                    str(model_dir), iters=1, warmup=1)
    assert [r["completions"] for r in micro] == [spec["prompts"] * spec["group_size"]] * 2
    assert [r["prompts"] for r in micro] == [r["prompts"] for r in ours]


def test_the_matched_checkpointing_config_checkpoints_on_both_sides(tmp_path):
    """``smollm2_t128_ckpt``'s settings (issue #34 item 4) on the quick shape: TRL's GRPOConfig gets
    ``gradient_checkpointing`` (off without the key), and both sides run a step with it."""
    try:
        from trl import GRPOConfig
    except ImportError:
        pytest.fail("the TRL side needs trl: pip install -r requirements-bench.txt (.ci/run does)", pytrace=False)
    from trl_runner import _trl_config, run_trl

    matched = bench_grpo.CONFIGS["smollm2_t128_ckpt"]
    assert matched["ours"]["execution"] == {"micro_batch_groups": 1, "gradient_checkpointing": True}
    spec = dict(bench_grpo.CONFIGS["quick"], trl_micro_batch=bench_grpo.CONFIGS["quick"]["group_size"],
                trl_gradient_checkpointing=True, ours=matched["ours"])
    assert _trl_config(GRPOConfig, spec, bench_grpo.COMMON, 1, False).gradient_checkpointing is True
    plain = _trl_config(GRPOConfig, bench_grpo.CONFIGS["quick"], bench_grpo.COMMON, 1, False)
    assert plain.gradient_checkpointing is False
    model_dir = bench_grpo.build_model_dir(spec, tmp_path / "m")
    trl_rows = run_trl(spec, bench_grpo.COMMON, bench_grpo.REWARD_FN, str(model_dir), iters=1, warmup=0)
    ours = bench_grpo.run_ours(spec, str(model_dir), iters=1, warmup=0)
    assert [r["prompts"] for r in trl_rows] == [r["prompts"] for r in ours]
    assert all(r["fwd_bwd_step"] > 0 for r in trl_rows + ours), (trl_rows, ours)


def test_the_bf16_rollout_config_samples_from_the_copy_and_records_the_gap(tmp_path):
    """``smollm2_gsm8k_bf16``'s settings on the quick shape: our side samples with the bf16 copy, so
    its rows carry the trainer/sampler log-prob gap that the plain config's never do."""
    bf16 = bench_grpo.CONFIGS["smollm2_gsm8k_bf16"]
    assert bf16["ours"]["sampling"] == {"rollout_precision": "bf16"} and bf16["ours"]["loss"] == {"rollout_is": "none"}
    assert {k: v for k, v in bf16.items() if k != "ours"} == \
        {k: v for k, v in bench_grpo.CONFIGS["smollm2_gsm8k"].items() if k != "ours"}  # the same shape otherwise
    spec = dict(bench_grpo.CONFIGS["quick"], ours=bf16["ours"])
    model_dir = str(bench_grpo.build_model_dir(spec, tmp_path / "m"))
    rows = bench_grpo.run_ours(spec, model_dir, iters=1, warmup=0)
    assert rows[0]["rollout_logp_gap_mean"] > 1e-4 and 0 <= rows[0]["rollout_is_capped_frac"] <= 1  # a bf16 gap
    assert bench_grpo.summarize(rows, 0)["rollout_logp_gap_mean"] == [rows[0]["rollout_logp_gap_mean"]]
    plain = bench_grpo.run_ours(bench_grpo.CONFIGS["quick"], model_dir, iters=1, warmup=0)
    assert "rollout_logp_gap_mean" not in plain[0] and "rollout_logp_gap_mean" not in bench_grpo.summarize(plain, 0)


def test_precision_sides_run_their_settings_beside_the_fp32_side_in_one_lockstep_run(tmp_path):
    """``--sides ours,ours+bf16,ours+autocast``: the workers run the same config and prompts, each
    with its own precisions; only the '+bf16' side samples from the copy, so only its summary
    carries the log-prob gap."""
    report = bench_grpo.main(["--configs", "quick", "--sides", "ours,ours+bf16,ours+autocast", "--iters", "1",
                              "--warmup", "0", "--repeats", "1", "--out-dir", str(tmp_path), "--name", "bf16_side"])
    quick = report["configs"]["quick"]
    assert quick["same_prompts"] is True
    runs = {side: rs[0] for side, rs in quick["runs"].items()}
    assert {side: r["precisions"] for side, r in runs.items()} == {
        "ours": {"execution": "fp32", "rollout": "fp32"}, "ours+bf16": {"execution": "fp32", "rollout": "bf16"},
        "ours+autocast": {"execution": "bf16", "rollout": "fp32"}}
    assert "rollout_logp_gap_mean" not in runs["ours"] and "rollout_logp_gap_mean" not in runs["ours+autocast"]
    assert runs["ours+bf16"]["rollout_logp_gap_mean"][0] > 1e-4
    assert (tmp_path / "bf16_side.json").exists()


def test_the_gsm8k_shaped_config_gives_both_sides_the_same_easy_gsm8k_prompts(tmp_path):
    """A config's ``task`` and ``task_params`` (``smollm2_gsm8k``'s: GSM8K problems of <= 2 steps)
    reach both sides: the same prompts step by step, and they are those problems."""
    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("the GSM8K-shaped config reads GSM8K: set GSM8K_DIR to a local copy of openai/gsm8k")
    from trl_runner import _dataset, run_trl

    from grpo_core.data.tasks import gsm8k

    shape = bench_grpo.CONFIGS["smollm2_gsm8k"]
    assert (shape["task"], shape["prompts"], shape["group_size"], shape["max_new_tokens"]) == ("gsm8k", 8, 16, 256)
    spec = dict(bench_grpo.CONFIGS["quick"], task="gsm8k", task_params=shape["task_params"],
                ours={"sampling": {"max_prompt_tokens": 4096}})
    model_dir = str(bench_grpo.build_model_dir(spec, tmp_path / "m"))
    ours = bench_grpo.run_ours(spec, model_dir, iters=1, warmup=0)
    trl = run_trl(spec, bench_grpo.COMMON, bench_grpo.REWARD_FN, model_dir, iters=1, warmup=0)
    assert [r["prompts"] for r in trl] == [r["prompts"] for r in ours]
    data, _ = _dataset(model_dir, 4, bench_grpo.COMMON["seed"], "gsm8k", shape["task_params"])
    easy = {r["prompt"]: r["think"].count("<<") for r in gsm8k.rows("train", gsm8k.resolve_source("openai/gsm8k"))}
    assert all(any(q in p and easy[q] <= 2 for q in easy) for p in data["prompt"])


def test_gpu_check_code_paths_on_cpu(tmp_path):
    gpu_check.FAILURES.clear()
    out = tmp_path / "g.json"
    assert gpu_check.main(["single", "--cpu-smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == [] and set(res["timings"]) == {"smollm2-135m", "qwen2-0.5b"}
    assert all(t["train_step_flops"] > 0 for t in res["timings"].values())
    assert res["correctness"]["lora_update_bf16_grad_cosine"] > 0.999
    # FLOPs: at least 6 x matmul params x tokens (the rule of thumb), attention on top
    c, (N, G, P, T) = gpu_check.SMOKE, (2, 2, 8, 8)
    assert gpu_check.flops_per_step(c, N, G, P, T) > 6 * c["hidden_size"] * c["intermediate_size"] * 3 * N * P


@pytest.mark.parametrize("nproc", [1, 2])
def test_gpu_check_ddp_and_fsdp2_part_on_cpu(tmp_path, nproc):
    """The multi-process part under real torchrun (gloo): DDP, then FSDP2 through the trainer
    (2 ranks) or sharded directly over a 1-rank group (one GPU's case), vs one process."""
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "benchmarks" / "gpu_check.py"), "ddp", "--cpu-smoke", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == [] and res["world_size"] == nproc
    assert res["fsdp2_worst_rel_grad_diff"] < 1e-3 and 0.99 < res["fsdp2_bf16_cosine"] < 1.0


def test_fsdp2_bench_runs_both_sides_on_a_tiny_model(monkeypatch, tmp_path):
    """bench_fsdp2's whole path (torchrun per side, the RESULT line, the table, the JSON) on a
    random 2-layer model: fsdp2 holds half of DDP's AdamW state per rank and gathers twice."""
    import bench_fsdp2

    monkeypatch.setattr(bench_fsdp2, "RESULTS", tmp_path)
    results = bench_fsdp2.main(["--source", "tiny", "--iters", "1", "--warmup", "0", "--name", "smoke"])
    by_side = {r["side"]: r["ranks"] for r in results}
    assert set(by_side) == {"ddp", "fsdp2"} and all(len(ranks) == 2 for ranks in by_side.values())
    ddp, fsdp2 = by_side["ddp"][0]["held_bytes"], by_side["fsdp2"][0]["held_bytes"]
    assert 0.4 < fsdp2["optimizer"] / ddp["optimizer"] < 0.6 and by_side["fsdp2"][0]["gathers_per_iter"] == 2
    assert json.loads((tmp_path / "smoke.json").read_text())["results"] == results


def test_head_lever_switches_the_chunked_lm_head_off(monkeypatch):
    from grpo_core.policy import scoring
    monkeypatch.setattr(scoring, "HEAD_CHUNK", scoring.HEAD_CHUNK)  # restored after the test
    assert bench_grpo.parse_side("ours-head") == ("ours", ["head"], False, None)
    bench_grpo.disable_levers(["head"])
    assert scoring.HEAD_CHUNK == 0


def test_pack_lever_switches_packed_scoring_off(monkeypatch):
    from grpo_core.policy import scoring
    monkeypatch.setattr(scoring, "PACKED", scoring.PACKED)  # restored after the test
    assert scoring.PACKED and bench_grpo.parse_side("ours-pack") == ("ours", ["pack"], False, None)
    bench_grpo.disable_levers(["pack"])
    assert scoring.PACKED is False


@pytest.mark.parametrize("lever", ["head", "chunks", "pack"])
def test_head_chunks_and_pack_levers_each_leave_the_packed_path(monkeypatch, lever):
    """Packed scoring needs the chunked head and replaces the length chunks: switching either lever
    off scores through the padded pieces, as the lever descriptions say."""
    from grpo_core.policy import packed_scoring, scoring
    from grpo_core.policy.scoring import completion_logprobs
    from tests.test_head_chunks import _rollout

    for name in ("PACKED", "HEAD_CHUNK", "SCORE_CALL_COST"):
        monkeypatch.setattr(scoring, name, getattr(scoring, name))  # restored after the test
    calls, real = [], packed_scoring.packed_hidden
    monkeypatch.setattr(scoring, "packed_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, batch = _rollout()
    completion_logprobs(model, batch, 1.0)
    bench_grpo.disable_levers([lever])
    completion_logprobs(model, batch, 1.0)
    assert calls == [1]


def test_saved_activations_see_the_whole_logits_only_without_head_chunks(monkeypatch):
    """bench_memory's breakdown counts what autograd saves: the model's own head saves [B, T+1, V]
    logits, head chunks of 4 positions save one [4, V] softmax instead; parameters never count."""
    import bench_memory

    from grpo_core.policy import scoring
    from grpo_core.policy.scoring import completion_logprobs
    from tests.test_head_chunks import _rollout

    model, batch = _rollout()
    B, T, V = *batch.completion_ids.shape, model.config.vocab_size
    saved = {}
    for chunk in (4, 0):
        monkeypatch.setattr(scoring, "HEAD_CHUNK", chunk)
        counter = bench_memory.SavedActivations()
        logp, _ = counter.wrap(completion_logprobs)(model, batch, 1.0, shared_prefix=False)
        logp.sum().backward()
        saved[chunk] = counter.largest
    assert 0 < saved[4] and saved[0] - saved[4] >= (B * T - 4) * V * 4, saved


def test_decode_benchmark_writes_tokens_per_second_for_every_shape_and_lever_state(tmp_path):
    """bench_decode at a tiny size: sampled, greedy and single-step shapes, each with the lever on
    and off, summarized against a positive floor, in a small JSON file."""
    import bench_decode

    from grpo_core.rollout import decode

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_decode reads GSM8K prompts: set GSM8K_DIR to a local copy of openai/gsm8k")
    default = decode.SHARED_PREFIX_ATTENTION
    report = bench_decode.main(["--model", "tiny", "--sampled", "2x2", "--greedy", "3", "--caps", "6",
                                "--step-shapes", "2x2", "--step-at", "3", "--step-reps", "1", "--repeats", "1",
                                "--levers", "shared_prefix", "--out-dir", str(tmp_path), "--name", "smoke"])
    seen = {(r["mode"], r["rows"], r["state"]) for r in report["summary"]}
    assert seen == {(m, n, s) for m, n in (("sampled", 4), ("greedy", 3), ("step", 4))
                    for s in ("all", "no_shared_prefix")}
    assert report["floor_tok_s"] > 0 and all(r["tok_s_q1_med_q3"][1] > 0 for r in report["summary"])
    assert all(0 < r["tokens"] <= r["rows"] * r["cap"] for r in report["runs"] if r["mode"] != "step")
    # each state sets its levers explicitly (the module's default is off) and leaves the default as it was
    assert decode.SHARED_PREFIX_ATTENTION is default
    whole = {r["state"]: r["levers"] for r in report["runs"] if r["mode"] != "step"}
    assert whole == {"all": {"shared_prefix": True}, "no_shared_prefix": {"shared_prefix": False}}
    layouts = {(r["state"], r["shared_prefix_layout"]) for r in report["runs"] if r["mode"] == "step"}
    assert layouts == {("all", True), ("no_shared_prefix", False)}  # G = 2: the lever applies
    written = tmp_path / "smoke.json"
    assert json.loads(written.read_text())["summary"] == report["summary"] and written.stat().st_size < 20_000


def test_decode_benchmark_runs_each_precision_side_by_side(tmp_path):
    """--precisions fp32,bf16: the same shape decoded by the model and by the engine's bf16 copy in
    every repeat, each summarized apart, the bf16 mm rate recorded beside the fp32 floor."""
    import bench_decode

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_decode reads GSM8K prompts: set GSM8K_DIR to a local copy of openai/gsm8k")
    report = bench_decode.main(["--model", "tiny", "--sampled", "2x2", "--greedy", "", "--caps", "5",
                                "--repeats", "2", "--precisions", "fp32,bf16", "--out-dir", str(tmp_path),
                                "--name", "smoke_bf16"])
    assert [r["precision"] for r in report["runs"]] == ["fp32", "bf16"] * 2  # A B A B
    assert {r["precision"]: r["runs"] for r in report["summary"]} == {"fp32": 2, "bf16": 2}
    assert report["mm_gflops_bf16"] > 0 and all(r["tok_s_q1_med_q3"][1] > 0 for r in report["summary"])
    with pytest.raises(ValueError, match="--precisions"):
        bench_decode.main(["--model", "tiny", "--precisions", "fp16", "--out-dir", str(tmp_path)])


def test_eval_split_benchmark_times_both_ways_and_checks_their_answers(tmp_path):
    """bench_eval_split at a tiny size: one process and the 2-worker split, timed in turn, with the
    share of greedy answers that agree (a tiny model decodes the same either way)."""
    import bench_eval_split

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_eval_split reads GSM8K problems: set GSM8K_DIR to a local copy of openai/gsm8k")
    report = bench_eval_split.main(["--model", "tiny", "--size", "5", "--sampled-size", "3", "--cap", "5",
                                    "--repeats", "1", "--out-dir", str(tmp_path), "--name", "smoke"])
    assert report["summary"]["split"]["workers"] == 2 and report["summary"]["one_process"]["workers"] == 1
    assert all(r["one_process"] > 0 and r["split"] > 0 for r in report["rounds"])
    assert report["split_over_one_median"] > 0
    assert report["same_greedy_answers"] == 1.0
    assert json.loads((tmp_path / "smoke.json").read_text())["rounds"] == report["rounds"]


def test_eval_plan_benchmark_times_this_checkout_against_a_commit(tmp_path):
    """bench_eval_plan at a tiny size against HEAD: both checkouts timed in turn, each importing
    its own grpo_core, the greedy answers of both sets compared, the worktree gone after it."""
    import bench_eval_plan

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_eval_plan reads GSM8K problems: set GSM8K_DIR to a local copy of openai/gsm8k")
    worktrees = lambda: subprocess.run(["git", "-C", str(REPO), "worktree", "list"], text=True,  # noqa: E731
                                       capture_output=True, check=True).stdout
    before = worktrees()
    report = bench_eval_plan.main(["--before", "HEAD", "--model", "tiny", "--sizes", "6,10", "--sampled-size", "3",
                                   "--cap", "5", "--repeats", "1", "--out-dir", str(tmp_path), "--name", "smoke"])
    assert set(report["rounds"][0]) == {"before", "after"} and all(v > 0 for v in report["rounds"][0].values())
    assert set(report["same_greedy_answers"]) == {"gsm8k_test", "gsm8k_test_le2"}
    assert report["same_greedy_answers"] == {"gsm8k_test": 1.0, "gsm8k_test_le2": 1.0}  # the same code both sides
    assert report["sampled_right"]["after"].keys() == {"gsm8k_test_le2"}
    assert worktrees() == before
    assert json.loads((tmp_path / "smoke.json").read_text())["rounds"] == report["rounds"]


def test_eval_plan_benchmark_compares_two_batch_sizes_of_one_checkout(tmp_path):
    """--before-batch-size / --batch-size: each side's job is built with its own evaluate.batch_size
    (the child reports the one it used), and each side's largest worker's peak RSS is recorded."""
    import bench_eval_plan

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_eval_plan reads GSM8K problems: set GSM8K_DIR to a local copy of openai/gsm8k")
    report = bench_eval_plan.main(["--before", "HEAD", "--before-batch-size", "4", "--batch-size", "3",
                                   "--model", "tiny", "--sizes", "6,10", "--cap", "5", "--repeats", "1",
                                   "--out-dir", str(tmp_path), "--name", "smoke"])
    assert report["batch_size"] == {"before": 4, "after": 3}
    rss = report["worker_peak_rss_gb"]
    assert all(0.1 < rss[way] < 20 for way in ("before", "after")), rss


def test_rollout_gap_figures_by_hand():
    """bench_rollout_gap's report on a hand-made gap: two completions, log-ratio sums 1.5 and -0.5."""
    import bench_rollout_gap
    import torch

    old = torch.tensor([[-1.0, -1.0, -7.0], [-2.0, -1.0, -1.0]])
    sampler = torch.tensor([[-2.0, -1.5, 0.0], [-1.5, -1.0, -1.0]])  # the third token of row 0 is off the mask
    mask = torch.tensor([[True, True, False], [True, True, True]])
    r = bench_rollout_gap.gap_report(old, sampler, mask, cap=3.0)
    assert (r["tokens"], r["completions"]) == (5, 2)
    assert r["gap_mean"] == pytest.approx(2.0 / 5) and r["gap_max"] == pytest.approx(1.0)
    assert r["signed_mean"] == pytest.approx(1.0 / 5)
    assert r["seq_logratio_quantiles"]["0.5"] == pytest.approx(0.5)  # the median of 1.5 and -0.5
    # token ratios e^1, e^0.5, e^-0.5, 1, 1: none above 3; sequence ratios e^1.5 = 4.48 > 3 and e^-0.5
    assert r["modes"]["token_truncate"]["capped_token_frac"] == 0.0
    assert r["modes"]["sequence_mask"] == {"capped_token_frac": pytest.approx(2 / 5), "completions_zeroed": 1}
    assert r["modes"]["sequence_truncate"]["completions_zeroed"] is None


def test_rollout_gap_benchmark_runs_the_bf16_engine_and_writes_its_report(tmp_path):
    import bench_rollout_gap

    if not os.environ.get("GSM8K_DIR"):
        pytest.fail("bench_rollout_gap reads GSM8K prompts: set GSM8K_DIR to a local copy of openai/gsm8k")
    report = bench_rollout_gap.main(["--model", "tiny", "--sampled", "2x2", "--cap", "5", "--out-dir", str(tmp_path),
                                     "--name", "smoke"])
    assert report["completions"] == 4 and 0 < report["tokens"] <= 20
    assert report["gap_mean"] > 0 and set(report["modes"]) == set(bench_rollout_gap.MODES)
    assert json.loads((tmp_path / "smoke.json").read_text())["gap_mean"] == report["gap_mean"]
