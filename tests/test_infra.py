"""infra/: the Kubernetes manifests and the training image, checked offline against the flow config.

No cluster and no docker daemon here: manifests are parsed, built with `kubectl kustomize`
when kubectl is on PATH, round-tripped through the kubernetes client's typed models when that
package is installed (a misspelt field is dropped by the models and fails the round trip),
and cross-checked with flows/configs/kubernetes.toml. The Dockerfile is read as text; its
requirements filter is run with grep. Nothing here proves the manifests apply or the image builds.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
K8S_TOML = ROOT / "flows" / "configs" / "kubernetes.toml"
NOT_KUSTOMIZED = {"kustomization.yaml", "secrets.example.yaml"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"}
NAMESPACE = "grpo"


# ---------------------------------------------------------------- helpers


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.y*ml") if p.name != "kustomization.yaml")


def all_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in manifest_files() for d in load(p)]


def kustomized_docs() -> list[dict]:
    kust = load(K8S / "kustomization.yaml")[0]
    return [d for name in kust["resources"] for d in load(K8S / name)]


def find(docs, kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"] if doc["kind"] in POD_TEMPLATE_KINDS else doc["spec"]


def containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def bucket(uri: str) -> str:
    assert uri.startswith("s3://"), uri
    return uri[len("s3://"):].split("/", 1)[0]


@pytest.fixture(scope="module")
def compute() -> dict:
    return tomllib.loads(K8S_TOML.read_text())["compute"]


@pytest.fixture(scope="module")
def k8s_cfg() -> dict:
    return tomllib.loads(K8S_TOML.read_text())


@pytest.fixture(scope="module")
def metaflow_cfg() -> dict:
    cm = find(kustomized_docs(), "ConfigMap", "metaflow-config")
    return json.loads(cm["data"]["config.json"])


@pytest.fixture(scope="module")
def mlflow_container() -> dict:
    (c,) = find(kustomized_docs(), "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"]
    return c


# ---------------------------------------------------------------- manifests: shape


def test_every_manifest_parses_and_names_itself():
    files = manifest_files()
    assert {p.name for p in files} >= {"namespace.yaml", "rbac.yaml", "metaflow-config.yaml",
                                       "mlflow.yaml", "postgres.yaml", "secrets.example.yaml"}
    for path, doc in all_docs():
        where = path.relative_to(ROOT)
        assert doc.get("apiVersion") and doc.get("kind"), f"{where}: apiVersion/kind missing"
        assert doc.get("metadata", {}).get("name"), f"{where}: {doc['kind']} has no metadata.name"
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{where}: {doc['kind']} not in {NAMESPACE}"


def test_kustomization_lists_exactly_the_resource_files():
    kust = load(K8S / "kustomization.yaml")[0]
    on_disk = {p.name for p in K8S.glob("*.yaml")} - NOT_KUSTOMIZED
    assert sorted(kust["resources"]) == sorted(on_disk)
    assert "secrets.example.yaml" not in kust["resources"]
    assert not any("examples" in r for r in kust["resources"])
    assert kust["namespace"] == NAMESPACE
    assert find(kustomized_docs(), "Namespace", NAMESPACE)


def test_kustomize_builds_the_listed_objects():
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not on PATH: install it (Debian: apt-get install kubernetes-client)", pytrace=False)
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    built = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d)
    assert built == sorted((d["kind"], d["metadata"]["name"]) for d in kustomized_docs())
    assert ("Secret", "grpo-s3-credentials") not in built


def test_manifests_round_trip_through_kubernetes_models():
    import kubernetes.client as k8s  # in requirements-dev.txt
    api = k8s.ApiClient()
    for path, doc in all_docs():
        model = "V1" + doc["kind"]
        text = json.dumps(doc)
        try:
            obj = api.deserialize(text, model, "application/json")     # kubernetes >= 35
        except TypeError:
            obj = api.deserialize(type("Resp", (), {"data": text})(), model)
        assert api.sanitize_for_serialization(obj) == doc, \
            f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']} has a field the API does not know"


# ---------------------------------------------------------------- names shared with kubernetes.toml


def test_metaflow_config_matches_the_flow_config(metaflow_cfg, compute, k8s_cfg):
    assert metaflow_cfg["METAFLOW_DEFAULT_DATASTORE"] == "s3"
    assert metaflow_cfg["METAFLOW_KUBERNETES_NAMESPACE"] == NAMESPACE
    assert metaflow_cfg["METAFLOW_KUBERNETES_SERVICE_ACCOUNT"] == compute["service_account"] == "grpo-runner"
    assert metaflow_cfg["METAFLOW_KUBERNETES_SECRETS"].split(",") == compute["secrets"] == ["grpo-s3-credentials"]
    assert metaflow_cfg["METAFLOW_KUBERNETES_CONTAINER_IMAGE"] == compute["image"]
    assert compute["image"] == "ghcr.io/grpo-pipeline/grpo-train:0.1.0"
    store = bucket(k8s_cfg["storage_root"])
    assert store == "grpo-artifacts"
    assert metaflow_cfg["METAFLOW_DATASTORE_SYSROOT_S3"] == f"s3://{store}/metaflow"
    assert bucket(metaflow_cfg["METAFLOW_DATATOOLS_S3ROOT"]) == store
    assert metaflow_cfg["METAFLOW_DEFAULT_METADATA"] in ("local", "service")
    if metaflow_cfg["METAFLOW_DEFAULT_METADATA"] == "service":
        assert metaflow_cfg.get("METAFLOW_SERVICE_URL")
    # GPU placement belongs to the training steps only, never to every step.
    assert not {"METAFLOW_KUBERNETES_NODE_SELECTOR", "METAFLOW_KUBERNETES_TOLERATIONS"} & set(metaflow_cfg)


def test_runner_service_account_and_rbac(compute):
    docs = kustomized_docs()
    sa = find(docs, "ServiceAccount", compute["service_account"])
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    binding = find(docs, "RoleBinding", "grpo-runner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "grpo-runner"}
    assert {"kind": "ServiceAccount", "name": compute["service_account"], "namespace": NAMESPACE} in binding["subjects"]
    role = find(docs, "Role", "grpo-runner")
    can = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
           for r in rule["resources"] for v in rule["verbs"]}
    for need in [("batch", "jobs", "create"), ("", "pods", "watch"), ("", "pods/log", "get"),
                 ("argoproj.io", "workflowtaskresults", "create"), ("jobset.x-k8s.io", "jobsets", "create")]:
        assert need in can, f"Role grpo-runner lacks {need}"
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])


def test_tracking_uri_resolves_to_the_mlflow_service(k8s_cfg, mlflow_container):
    uri = urlparse(k8s_cfg["tracking_uri"])
    assert (uri.scheme, uri.hostname, uri.port) == ("http", "mlflow.grpo.svc.cluster.local", 5000)
    svc_name, ns, *rest = uri.hostname.split(".")
    assert rest == ["svc", "cluster", "local"]
    docs = kustomized_docs()
    svc = find(docs, "Service", svc_name)
    assert svc["metadata"]["namespace"] == ns == NAMESPACE
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == uri.port]
    named = {p["name"]: p["containerPort"] for p in mlflow_container["ports"]}
    assert named[port["targetPort"]] == uri.port
    labels = find(docs, "Deployment", "mlflow")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    # MLflow 3 answers 403 to API calls whose Host header is not allowed (probes are exempt).
    allowed = env_of(mlflow_container)["MLFLOW_SERVER_ALLOWED_HOSTS"]["value"].split(",")
    assert uri.netloc in allowed and uri.hostname in allowed


def test_mlflow_server_command(k8s_cfg, mlflow_container):
    c = mlflow_container
    image, _, tag = c["image"].rpartition(":")
    assert image == "ghcr.io/mlflow/mlflow" and re.fullmatch(r"v\d+\.\d+\.\d+-full", tag), c["image"]
    argv = c["command"] + c["args"]
    assert argv[:2] == ["mlflow", "server"]
    opt = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}
    assert opt["--host"] == "0.0.0.0"
    assert int(opt["--port"]) == 5000 == c["ports"][0]["containerPort"]
    assert opt["--artifacts-destination"] == f"s3://{bucket(k8s_cfg['storage_root'])}/mlflow"
    assert "--backend-store-uri" not in opt      # comes from the env, password included
    env = c["env"]
    names = [e["name"] for e in env]
    by_name = env_of(c)
    assert by_name["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
    assert by_name["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-postgres", "key": "password"}
    store = urlparse(by_name["MLFLOW_BACKEND_STORE_URI"]["value"])
    assert store.scheme.startswith("postgresql") and store.password == "$(POSTGRES_PASSWORD)"
    # $(VAR) expands only from variables defined earlier in the list.
    assert names.index("POSTGRES_PASSWORD") < names.index("MLFLOW_BACKEND_STORE_URI")
    pg_svc, pg_ns, *_ = store.hostname.split(".")
    pg = find(kustomized_docs(), "Service", pg_svc)
    assert pg_ns == NAMESPACE and store.port == pg["spec"]["ports"][0]["port"] == 5432
    assert store.path == "/" + env_of(find(kustomized_docs(), "StatefulSet", pg_svc)["spec"]["template"]["spec"]
                                      ["containers"][0])["POSTGRES_DB"]["value"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_postgres_statefulset():
    docs = kustomized_docs()
    sts = find(docs, "StatefulSet", "mlflow-postgres")
    svc = find(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"postgres:\d+\.\d+\S*", c["image"]), c["image"]
    env = env_of(c)
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-postgres", "key": "password"}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}[claim["metadata"]["name"]]
    assert env["PGDATA"]["value"].startswith(mount + "/")     # not the volume root (lost+found)


def test_gpu_example_matches_the_compute_config(compute):
    job = find(load(K8S / "examples" / "gpu-check-job.yaml"), "Job", "grpo-gpu-check")
    spec = pod_spec(job)
    (c,) = spec["containers"]
    assert spec["nodeSelector"] == compute["node_selector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == compute["tolerations"]
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["serviceAccountName"] == compute["service_account"]
    assert [e["secretRef"]["name"] for e in c["envFrom"]] == compute["secrets"]
    assert c["image"] == compute["image"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(compute["gpu"])
    assert c["resources"]["requests"]["cpu"] == str(compute["cpu"])
    assert c["resources"]["limits"]["memory"] == f"{compute['memory']}M"
    assert env_of(c)["OMP_NUM_THREADS"]["value"] == str(compute["threads_per_proc"])
    script = c["args"][0]
    assert f"--nproc_per_node={compute['nproc_per_node']}" in script
    assert f"assert n == {compute['gpu']}" in script


# ---------------------------------------------------------------- secrets and pod security

SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|PRIVATE", re.I)


def test_no_secret_values_in_kustomized_resources():
    docs = kustomized_docs()
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = "\n".join((K8S / n).read_text() for n in load(K8S / "kustomization.yaml")[0]["resources"])
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)                       # AWS access key id
    assert not re.search(r"postgres(ql)?(\+\w+)?://[^:/\s]+:(?!\$\()[^@\s]+@", text)   # inline password
    for d in docs:
        if d["kind"] not in POD_TEMPLATE_KINDS:
            continue
        for c in containers(d):
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{e['name']} must come from a Secret"
            for src in c.get("envFrom", []):
                assert "secretRef" in src or "configMapRef" in src


def test_secret_template_holds_only_placeholders():
    docs = load(K8S / "secrets.example.yaml")
    assert {d["metadata"]["name"] for d in docs} == {"grpo-s3-credentials", "mlflow-postgres"}
    for d in docs:
        assert d["kind"] == "Secret" and "data" not in d
        assert all(v == "REPLACE_ME" for v in d["stringData"].values()), d["stringData"]
    assert "NOT APPLIED" in (K8S / "secrets.example.yaml").read_text()


def test_every_container_is_non_root_and_bounded():
    checked = 0
    for path, doc in all_docs():
        if doc["kind"] not in POD_TEMPLATE_KINDS | {"Pod"}:
            continue
        assert pod_spec(doc)["securityContext"]["runAsNonRoot"] is True
        for c in containers(doc):
            where = f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert sc.get("runAsUser", 1) != 0, where
            res = c.get("resources", {})
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), where
            assert res.get("limits", {}).get("memory"), where
            checked += 1
    assert checked >= 3      # mlflow, postgres, the GPU check


# ---------------------------------------------------------------- the training image


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, cur = [], ""
    for line in (INFRA / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def test_dockerfile_base_user_workdir_env():
    ins = dockerfile()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    (base,) = [a for k, a in ins if k == "FROM"]
    base = args.get(base.strip("${}"), base)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", base), base
    users = [a for k, a in ins if k == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: use a numeric non-root uid"
    assert uid == "1000"
    workdir = [a for k, a in ins if k == "WORKDIR"][-1]
    assert workdir not in ("/", "") and workdir.startswith("/home/")
    env = " ".join(a for k, a in ins if k == "ENV")
    assert "PYTHONUNBUFFERED=1" in env and "METAFLOW_SKIP_INSTALL_DEPENDENCIES=1" in env
    for k, a in ins:
        if k in ("ENV", "ARG"):
            assert not SECRETISH.search(a), f"{k} {a}: no credentials in the image"


def test_dockerfile_installs_requirements_and_project_without_torch():
    ins = dockerfile()
    runs = [a for k, a in ins if k == "RUN"]
    copies = [a for k, a in ins if k == "COPY"]
    assert any(c.split()[0] == "requirements.txt" for c in copies)
    pip_cmds = [shlex.split(p.strip()) for r in runs for p in r.split(";") if "pip install" in p]
    req = [c for c in pip_cmds if "-r" in c]
    assert len(req) == 1 and "-c" in req[0], "one `pip install -r` with a constraints file pinning torch"
    assert req[0][req[0].index("-r") + 1] != "/tmp/build/requirements.txt", "install the filtered file"
    assert any("--no-deps" in c and "-r" not in c for c in pip_cmds), "project: pip install --no-deps ."
    for c in pip_cmds:
        assert not any(re.match(r"torch([=<>~!\[]|$)", t) for t in c), f"reinstalls torch: {c}"
    assert any("cmp - /tmp/build/torch.lock" in r for r in runs), "a check that torch is unchanged"


def test_requirements_filter_drops_only_torch(tmp_path):
    run = next(a for k, a in dockerfile() if k == "RUN" and "grep -v" in a)
    pattern = shlex.split(re.search(r"grep -viE ('[^']+')", run).group(1))[0]
    reqs = ["torch==2.13.0+cpu", "Torch >= 2.1", "torch", "torch ; python_version>'3'",
            "torchvision==0.28.0", "torch-foo==1.0", "transformers==5.24.0", "mlflow==3.17.2"]
    (tmp_path / "r.txt").write_text("\n".join(reqs) + "\n")
    out = subprocess.run(["grep", "-viE", pattern, str(tmp_path / "r.txt")],
                         capture_output=True, text=True).stdout.split("\n")
    assert [line for line in out if line] == ["torchvision==0.28.0", "torch-foo==1.0",
                                              "transformers==5.24.0", "mlflow==3.17.2"]


def test_requirements_torch_pin_matches_the_base_image():
    req = ROOT / "requirements.txt"
    pins = re.findall(r"(?im)^\s*torch\s*==\s*([\d.]+)", req.read_text())
    base = next(a for k, a in dockerfile() if k == "ARG" and a.startswith("BASE_IMAGE="))
    if pins:
        assert pins == [re.search(r":(\d+\.\d+\.\d+)-", base).group(1)], \
            "torch in requirements.txt and in the base image must be the same version"
    # Metaflow's task bootstrap needs boto3 in the image (runtime pip is switched off).
    assert re.search(r"(?im)^\s*boto3\s*==", req.read_text()), "pin boto3 in requirements.txt"


def test_build_context_is_allow_listed():
    lines = [ln.strip() for ln in (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert {"requirements.txt", "pyproject.toml", "grpo_core"} <= allowed
    assert not allowed & {".venv", ".git", ".grpo", "outputs", "mfhome"}
