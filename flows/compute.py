"""``@train_compute``: training steps become Kubernetes GPU pods when the config says so.

A StepMutator reads the flow's ``cfg`` at deploy time and, only for ``compute.backend =
"kubernetes"``, adds ``@kubernetes(gpu, cpu, memory, image, service_account, secrets,
node_selector, tolerations, shared_memory, disk)`` to the step it decorates. Locally nothing is added, so the same
flow file runs on a laptop and on a cluster. (``@kubernetes`` written statically would demand
an S3 datastore and a kubeconfig even for local runs; ``--with kubernetes`` would put every
step on the cluster.) The namespace comes from METAFLOW_KUBERNETES_NAMESPACE, not from here:
Argo Workflows rejects per-step namespaces.
"""
from metaflow import StepMutator


class train_compute(StepMutator):
    def pre_mutate(self, mutable_step):
        cfg = dict(mutable_step.flow.configs)["cfg"]
        c = cfg.compute
        if c.backend != "kubernetes":
            return
        kw = {"gpu": c.gpu, "cpu": c.cpu, "memory": c.memory}
        for name in ("image", "service_account", "shared_memory", "disk"):
            if c.get(name):
                kw[name] = c[name]
        if c.get("secrets"):
            kw["secrets"] = list(c.secrets)
        if c.get("node_selector"):
            kw["node_selector"] = dict(c.node_selector)
        if c.get("tolerations"):
            kw["tolerations"] = [dict(t) for t in c.tolerations]
        mutable_step.add_decorator("kubernetes", deco_kwargs=kw)
