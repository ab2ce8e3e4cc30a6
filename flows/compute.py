"""``@train_compute`` and ``@eval_compute``: steps that become Kubernetes pods when the config says so.

A StepMutator reads the flow's ``cfg`` at deploy time and, only for ``compute.backend =
"kubernetes"``, adds ``@kubernetes(gpu, cpu, memory, image, service_account, secrets,
node_selector, tolerations, shared_memory, disk)`` to the step it decorates. Training steps get
``compute.gpu`` GPUs per node (one torchrun rank each) and ``port = compute.rdzv_port``; being
``@parallel`` steps, each compiles to a JobSet of ``compute.nodes`` such pods. Each evaluation
task gets the same pod with one GPU: greedy decoding of three checkpoints over 1,319 GSM8K
items would take hours on a launcher's CPU, or OOM a default 4 GB pod under Argo. Locally
nothing is added, so the same flow file runs on a laptop and on a cluster. (``@kubernetes``
written statically would demand an S3 datastore and a kubeconfig even for local runs; ``--with
kubernetes`` would put every step on the cluster.) The namespace comes from
METAFLOW_KUBERNETES_NAMESPACE, not from here: Argo Workflows rejects per-step namespaces.

The values come from the validated ``PipelineConfig`` (defaults filled in, ranges checked), not
the raw TOML: a config that leaves out ``gpu``/``cpu``/``memory`` gets ``ComputeConfig``'s
defaults, and a bad config fails here, at flow construction, with the ``ConfigError`` naming the
field, before anything is deployed. A ``GRPO_STORAGE_ROOT`` set on the launcher (it overrides
``storage_root``) is passed to the pods with ``@environment``: they rebuild and validate the
config too, and without it would check, and fail on, the TOML's root.
"""
import os

from metaflow import StepMutator

from grpo_core.config.pipeline import PipelineConfig


def _add_kubernetes(mutable_step, gpus=lambda c: c.gpu, gang=False) -> None:
    c = PipelineConfig.from_dict(dict(dict(mutable_step.flow.configs)["cfg"])).compute
    if c.backend != "kubernetes":
        return
    kw = {"gpu": gpus(c), "cpu": c.cpu, "memory": c.memory}
    if gang:  # the port torchrun's ranks meet on, opened on the gang's pods (MF_MASTER_PORT)
        kw["port"] = c.rdzv_port
    for name in ("image", "service_account", "shared_memory", "disk"):
        if getattr(c, name):
            kw[name] = getattr(c, name)
    if c.secrets:
        kw["secrets"] = list(c.secrets)
    if c.node_selector:
        kw["node_selector"] = dict(c.node_selector)
    if c.tolerations:
        kw["tolerations"] = [dict(t) for t in c.tolerations]
    mutable_step.add_decorator("kubernetes", deco_kwargs=kw)
    root = os.environ.get("GRPO_STORAGE_ROOT")
    if root:  # the pod rebuilds and validates the config as the launcher did: same storage root
        mutable_step.add_decorator("environment", deco_kwargs={"vars": {"GRPO_STORAGE_ROOT": root}})


class train_compute(StepMutator):
    def pre_mutate(self, mutable_step):
        _add_kubernetes(mutable_step, gang=True)


class eval_compute(StepMutator):
    def pre_mutate(self, mutable_step):
        _add_kubernetes(mutable_step, gpus=lambda c: min(c.gpu, 1))
