"""The flow's deployment specs, offline: the Kubernetes config puts GPUs on exactly the training
and evaluation steps, a launcher's storage root reaches the pods, the local config adds no
Kubernetes, and the Argo spec (against a moto S3 datastore) makes each training step a JobSet gang.
"""
import json
import os
import re
import subprocess
import sys
import tomllib

from tests.conftest import S3_ENV
from tests.flow_helpers import FLOW, K8S_CFG, TRAINING_STEPS, mf_env, s3_creds


def _output_raw(root, *cfg_args, env_extra=None):
    env = {**os.environ, **mf_env(root), "METAFLOW_DATASTORE_SYSROOT_S3": "s3://ci-bucket/metaflow",
           **(env_extra or {})}
    out = subprocess.run([sys.executable, FLOW, "--datastore", "s3", *cfg_args, "output-raw", "--json"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["graph"]


def test_kubernetes_config_puts_gpus_on_exactly_the_training_and_evaluation_steps(tmp_path):
    graph = _output_raw(tmp_path, "--config", "cfg", K8S_CFG)
    with open(K8S_CFG, "rb") as f:
        compute = tomllib.load(f)["compute"]
    for name, node in graph.items():
        decos = {d["name"]: d["attributes"] for d in node.get("decorators", [])}
        if name in TRAINING_STEPS | {"evaluate"}:
            k = decos["kubernetes"]
            assert int(k["gpu"]) == (compute["gpu"] if name in TRAINING_STEPS else 1), name
            assert ("parallel" in decos) == (name in TRAINING_STEPS), name
            if name in TRAINING_STEPS:  # the gang's rendezvous port, opened on its pods
                assert int(k["port"]) == compute["rdzv_port"], name
            assert k["image"] == compute["image"] and k["service_account"] == compute["service_account"]
        else:
            assert "kubernetes" not in decos, name


def test_a_launcher_storage_root_override_reaches_the_pods(tmp_path):
    """The TOML keeps a local storage_root, the launcher exports an s3:// GRPO_STORAGE_ROOT: each
    pod step gets it through @environment (its config validation would refuse the local root)."""
    with open(K8S_CFG, "rb") as f:
        text = f.read().decode().replace('storage_root = "s3://grpo-artifacts/pipeline"',
                                         'storage_root = ".grpo/artifacts"')
    local_root = tmp_path / "k8s_local_root.toml"
    local_root.write_text(text)
    graph = _output_raw(tmp_path, "--config", "cfg", str(local_root),
                        env_extra={"GRPO_STORAGE_ROOT": "s3://other-bucket/pipeline"})
    for name, node in graph.items():
        decos = {d["name"]: d["attributes"] for d in node.get("decorators", [])}
        if "kubernetes" in decos:
            assert decos["environment"]["vars"] == {"GRPO_STORAGE_ROOT": "s3://other-bucket/pipeline"}, name
    assert {n for n, node in graph.items() if "kubernetes" in {d["name"] for d in node.get("decorators", [])}} == \
        TRAINING_STEPS | {"evaluate"}


def test_local_config_adds_no_kubernetes(tmp_path):
    graph = _output_raw(tmp_path)
    assert all("kubernetes" not in {d["name"] for d in n.get("decorators", [])} for n in graph.values())


def test_argo_spec_requests_gpus_only_for_training_and_evaluation(tmp_path, s3_server):
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", **s3_creds()).create_bucket(Bucket="ci-bucket")
    env = {**os.environ, **mf_env(tmp_path), **S3_ENV, "METAFLOW_S3_ENDPOINT_URL": s3_server,
           "METAFLOW_DATASTORE_SYSROOT_S3": "s3://ci-bucket/metaflow", "METAFLOW_KUBERNETES_NAMESPACE": "grpo"}
    out = subprocess.run([sys.executable, FLOW, "--datastore", "s3", "--config", "cfg", K8S_CFG,
                          "argo-workflows", "create", "--only-json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    spec = json.loads(out.stdout[out.stdout.index("{"):])
    templates = {t["name"].replace("-", "_"): t for t in spec["spec"]["templates"]}
    res = {name: t["container"]["resources"] for name, t in templates.items() if "container" in t}
    assert res["evaluate"]["limits"]["nvidia.com/gpu"] == "1", res["evaluate"]
    for name in ("start", "load_sft", "join_curriculum", "begin_gsm8k", "join_gsm8k", "register", "end"):
        assert "nvidia.com/gpu" not in res[name].get("limits", {}), name
    for name in TRAINING_STEPS:  # a gang: one JobSet, its control pod (node 0) plus nodes - 1 workers
        jobset = _manifest(templates[name]["resource"]["manifest"])
        assert jobset["kind"] == "JobSet" and templates[name]["resource"]["action"] == "create"
        jobs = {j["name"]: j for j in jobset["spec"]["replicatedJobs"]}
        assert set(jobs) == {"control", "worker"} and jobs["control"]["replicas"] == 1
        assert "workerCount" in str(jobs["worker"]["replicas"])  # num_parallel - 1, set when the step starts
        for job in jobs.values():
            pod = job["template"]["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "4", name
            assert c["image"] == "ghcr.io/grpo-pipeline/grpo-train:0.1.0"
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["MF_MASTER_PORT"] == "29400" and env["MF_MASTER_ADDR"].endswith(".grpo.svc.cluster.local")
            assert {"medium": "Memory", "sizeLimit": "16384Mi"} in [v.get("emptyDir") for v in pod["volumes"]]
    # the gang's size: the step before each training step hands Argo num_parallel at run time
    for before, gang in (("load_sft", "curriculum_grpo"), ("begin_gsm8k", "gsm8k_grpo")):
        outputs = {p["name"] for p in templates[before]["outputs"]["parameters"]}
        assert "num-parallel" in outputs, (before, outputs)
        assert gang.replace("_", "-") in json.dumps(templates[f"{before}_foreach_parallel"]["dag"])


def _manifest(text: str) -> dict:
    """A JobSet manifest from an Argo resource template: its ``{{=expr}}`` fields become strings."""
    import yaml

    return yaml.safe_load(re.sub(r"(:\s*)(\{\{=[^\n]*\}\})", lambda m: m.group(1) + json.dumps(m.group(2)), text))
