"""GRPO post-training, end to end.

1. start            validate the config, fingerprint the datasets, open the MLflow parent run
2. load_sft         the SFT checkpoint (GGUF -> HF dir once, a hub id or dir, or a bootstrap)
3. curriculum_grpo  torchrun GRPO on generated arithmetic (promotion gate may end it early)
4. gsm8k_grpo       torchrun GRPO on GSM8K train, from the curriculum checkpoint
5. evaluate         greedy held-out accuracy of every stage's checkpoint (foreach), joined
6. register         MLflow Model Registry: champion/challenger by a paired test
7. end              summary table

Each training step is a ``@parallel`` gang of ``compute.nodes`` tasks (one per node, 1 by
default), each running torchrun; the join after it keeps node 0's result.

    python flows/grpo_flow.py run                                          # local default
    python flows/grpo_flow.py --datastore s3 --config cfg flows/configs/kubernetes.toml run
    python flows/grpo_flow.py resume                                       # after a failure
"""
import os
import sys
from pathlib import Path

# Metaflow refuses to run without a user name (and as 'root'); containers often have neither.
if all(os.environ.get(v, "root") == "root" for v in ("METAFLOW_USER", "USERNAME", "USER")):
    os.environ["METAFLOW_USER"] = "grpo"
# Metaflow starts a local gang's other tasks with the `python` found on PATH: make it this one.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

from metaflow import Config, FlowSpec, card, current, parallel, step

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig, parse_config_text
from grpo_core.config.stages import GRPO_STAGES
from grpo_core.pipeline import evaluation_step, launcher
from grpo_core.pipeline import steps as pipeline

from cards import registry_card, stage_table_card, training_card, training_result
from compute import eval_compute, train_compute

LOCAL_DEFAULT = str(Path(__file__).resolve().parent / "configs" / "local.toml")


def checked_config(text: str) -> dict:
    """The flow's config, validated as Metaflow reads it: a bad field stops the command with the
    one-line ConfigError (naming the field and the fix), not under a traceback."""
    data = parse_config_text(text)
    try:
        PipelineConfig.from_dict(data)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None
    return data


class GRPOFlow(FlowSpec):
    cfg = Config("cfg", default=LOCAL_DEFAULT, parser=checked_config)

    @property
    def pc(self) -> PipelineConfig:
        """The typed config, parsed once per step's process (a private attribute: Metaflow does
        not store it as an artifact; ``cfg`` is the artifact)."""
        if getattr(self, "_pc", None) is None:
            self._pc = PipelineConfig.from_dict(dict(self.cfg))
        return self._pc

    @step
    def start(self):
        """Validate the config, fingerprint the data, open the MLflow parent run."""
        pc = self.pc
        self.datasets = pipeline.dataset_identities(pc)
        tags = {"metaflow.flow": current.flow_name, "metaflow.run_id": current.run_id,
                "metaflow.pathspec": current.pathspec, "grpo.config": pc.name,
                "git.commit": os.environ.get("GIT_COMMIT") or pipeline.git_commit()}
        uri, parent = pipeline.open_tracking(pc, tags, run_name=f"{current.flow_name}-{current.run_id}")
        self.ctx = pipeline.RunContext(current.flow_name, current.run_id, None, pipeline.storage_root(pc),
                                       uri, parent)
        self.next(self.load_sft)

    @step
    def load_sft(self):
        """Resolve (or bootstrap) the SFT checkpoint into storage."""
        self.sft_uri, self.sft_metrics = pipeline.load_sft(self.pc, self._ctx(), self.datasets)
        self.next(self.curriculum_grpo, num_parallel=self.pc.compute.nodes)

    @card(type="blank", id="training", refresh_interval=10)
    @train_compute
    @parallel
    @step
    def curriculum_grpo(self):
        """GRPO on the arithmetic curriculum under torchrun (this node's ranks)."""
        self.curriculum = self._train("curriculum", self.sft_uri)
        self.next(self.join_curriculum)

    @step
    def join_curriculum(self, inputs):
        """The curriculum stage's result, from the node that holds rank 0."""
        self.curriculum = launcher.first_node([i.curriculum for i in inputs])
        self.merge_artifacts(inputs, exclude=["curriculum"])
        self.next(self.begin_gsm8k)

    @step
    def begin_gsm8k(self):
        """Start the GSM8K gang (Metaflow: a join step cannot also start one)."""
        self.next(self.gsm8k_grpo, num_parallel=self.pc.compute.nodes)

    @card(type="blank", id="training", refresh_interval=10)
    @train_compute
    @parallel
    @step
    def gsm8k_grpo(self):
        """GRPO on GSM8K train under torchrun (this node's ranks), from the curriculum checkpoint."""
        self.gsm8k = self._train("gsm8k", self.curriculum["model_uri"])
        self.next(self.join_gsm8k)

    @step
    def join_gsm8k(self, inputs):
        """The GSM8K stage's result, from the node that holds rank 0."""
        self.gsm8k = launcher.first_node([i.gsm8k for i in inputs])
        self.merge_artifacts(inputs, exclude=["gsm8k"])
        self.next(self.begin_evaluation)

    @step
    def begin_evaluation(self):
        """Evaluate every stage's model, one task each (Metaflow: a join step cannot also split)."""
        self.stages = [("sft", self.sft_uri)] + [(s.name, getattr(self, s.name)["model_uri"]) for s in GRPO_STAGES]
        self.next(self.evaluate, foreach="stages")

    @eval_compute
    @step
    def evaluate(self):
        """Greedy accuracy of one stage's checkpoint on the same held-out items."""
        stage, uri = self.input
        self.result = evaluation_step.evaluate_checkpoint(self.pc, stage, uri, self.datasets)
        self.next(self.join_evaluations)

    @card(type="blank", id="evaluation")
    @step
    def join_evaluations(self, inputs):
        """Collect every stage's results, pair each with the start model's, log them named by their data."""
        self.merge_artifacts(inputs, include=["ctx", "datasets", "sft_metrics", *(s.name for s in GRPO_STAGES)])
        ordered = evaluation_step.in_stage_order([i.result for i in inputs])
        self.results = evaluation_step.paired_with_start(ordered)
        evaluation_step.log_evaluation(self._ctx(), self.results, self.datasets)
        stage_table_card(current.card["evaluation"], self.results)
        self.next(self.register)

    @card(type="blank", id="registry")
    @step
    def register(self):
        """Register the final model; promote it only if it beats the champion (the first one: the start model)."""
        self.registry = pipeline.register(self.pc, self._ctx(), self.results[-1], self.datasets,
                                          current.pathspec, start=self.results[0])
        registry_card(current.card["registry"], self.registry)
        self.next(self.end)

    @step
    def end(self):
        """Send any tracking points a stage kept for later, print the summary, close the MLflow runs."""
        trained = {s.name: getattr(self, s.name) for s in GRPO_STAGES}
        pipeline.replay_tracking(self._ctx().tracking_uri, list(trained.values()))
        print(evaluation_step.summary_table(self.results, trained, self.registry))
        pipeline.finish(self._ctx())

    # -- helpers (no pipeline logic here; see grpo_core.pipeline.steps)
    def _ctx(self) -> pipeline.RunContext:
        ctx = pipeline.RunContext(**{**self.ctx.__dict__, "run_id": current.run_id,
                                     "origin_run_id": current.origin_run_id})
        return ctx.in_this_process(self.pc.tracking_uri)

    def _train(self, stage: str, model_uri: str) -> dict:
        pc, ctx = self.pc, self._ctx()
        gang = launcher.Gang(pc.compute.nodes, current.parallel.node_index, current.parallel.main_ip,
                             pc.compute.rdzv_port, f"{current.run_id}-{current.step_name}")
        stage_cfg = pipeline.stage_config(pc, stage, current.step_name, model_uri, ctx, self.datasets,
                                          node_index=gang.node_index)
        summary = launcher.launch_stage(stage_cfg, pc.compute.nproc_per_node, pc.compute.threads_per_proc,
                                        on_progress=training_card(current.card["training"], stage), gang=gang)
        if gang.leads:
            training_result(current.card["training"], summary)
        return summary


if __name__ == "__main__":
    GRPOFlow()
