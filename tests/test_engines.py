"""The rollout-engine seam: the trainer samples only through ``sync_weights`` + ``generate``,
and a stage's ``rollout_engine`` picks the engine by name."""
import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.groups import ROLLOUT_ENGINES
from grpo_core.config.stage import GRPOConfig
from grpo_core.model.loading import build_tiny
from grpo_core.rollout import engines
from grpo_core.train.entry import main
from tests.helpers import SEVENS, stage_args


def test_the_config_accepts_exactly_the_engines_rollout_can_build():
    assert tuple(engines.ENGINES) == ROLLOUT_ENGINES
    for name in ROLLOUT_ENGINES:
        cfg = GRPOConfig(runtime=dict(model="m", output_dir="o"), sampling=dict(rollout_engine=name))
        assert cfg.sampling.rollout_engine == name


def test_an_unknown_engine_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"rollout_engine.*'sglang'.*auto.*decoder.*generate.*vllm"):
        GRPOConfig(runtime=dict(model="m", output_dir="o"), sampling=dict(rollout_engine="sglang"))


class RecordingEngine(engines.InProcessEngine):
    """The in-process engine, recording what the trainer hands it."""

    calls: list = []

    def sync_weights(self, model) -> None:
        RecordingEngine.calls.append(("sync", model))
        super().sync_weights(model)

    def generate(self, rows, group_size, sampling):
        RecordingEngine.calls.append(("generate", len(rows), group_size, sampling))
        return super().generate(rows, group_size, sampling)

    def close(self) -> None:
        RecordingEngine.calls.append(("close",))


def test_the_trainer_samples_only_through_the_selected_engine(tiny, tmp_path, monkeypatch):
    """One engine entry is all a new engine needs: registered under a name, selected by the
    stage config, synced with the live policy before every rollout and given
    the stage's sampling settings."""
    import grpo_core.train.trainer as trainer_mod

    monkeypatch.setitem(engines.ENGINES, "generate", lambda tok, cfg: RecordingEngine(tok, "generate"))
    policies = []
    real_init = trainer_mod.Trainer.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        policies.append(self.policy.model)

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", init)
    RecordingEngine.calls = []
    main(stage_args(runtime=dict(model=str(tiny), output_dir=str(tmp_path)), rewards=SEVENS, iterations=2,
                    prompts_per_iter=3,
                    sampling=dict(group_size=4, max_new_tokens=7, temperature=0.9, rollout_engine="generate"),
                    checkpoint=dict(every=2)))
    calls = RecordingEngine.calls
    assert [c[0] for c in calls] == ["sync", "generate"] * 2 + ["close"]  # before each of the 2 rollouts; at the end
    assert all(c[1] is policies[0] for c in calls if c[0] == "sync")
    sampling = calls[1][3]
    assert (calls[1][1], calls[1][2]) == (3, 4)
    assert (sampling.temperature, sampling.max_new_tokens, sampling.top_k) == (0.9, 7, 0)


def test_the_decoder_engine_refuses_a_model_it_does_not_support():
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = build_tiny("llama", hidden=32, layers=1, heads=2)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    engine = engines.build("decoder", tok)
    engine.sync_weights(gpt2)
    with pytest.raises(ValueError, match=r"rollout_engine = 'decoder'.*GPT2LMHeadModel.*'auto' or 'generate'"):
        engine.generate([{"prompt": "1+1"}], 2, engines.Sampling())
    fallback = engines.build("auto", tok)
    fallback.sync_weights(gpt2)
    assert len(fallback.generate([{"prompt": "1+1", "gold": "2"}], 2, engines.Sampling(max_new_tokens=3))) == 2


def test_generate_before_sync_weights_is_an_error():
    _, tok = build_tiny("llama", hidden=32, layers=1, heads=2)
    with pytest.raises(RuntimeError, match=r"sync_weights\(model\) must come before generate"):
        engines.build("auto", tok).generate([{"prompt": "1+1"}], 2, engines.Sampling())


def test_reward_functions_see_every_column_but_the_id_and_the_worked_solution():
    from tests.helpers import fixed_rollout_batch

    batch = fixed_rollout_batch()
    n = len(batch)
    batch.columns = {"id": ["a"] * n, "gold": ["7"] * n, "think": ["3+4=7"] * n, "difficulty": [1] * n}
    assert batch.reward_columns() == {"gold": ["7"] * n, "difficulty": [1] * n}
