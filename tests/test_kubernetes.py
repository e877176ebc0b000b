"""launch/kubernetes/flodl-job.yaml, the Kubernetes recipe (docs/kubernetes.md).

No cluster can run on these machines (kind, k3s and minikube need a container engine, and there
is none), so the manifest is checked two ways: its pieces agree with one another and with flodl's
own command lines (the controller's flags resolve, the workers dial the address the controller
advertises, the worker count is the same in both), and every document validates, strictly (an
unknown field is an error), against Kubernetes' own OpenAPI schema with kubernetes-validate.
"""

from __future__ import annotations

import copy

import pytest

from flodl.controller.launch import build_parser, resolve
from flodl.worker import build_parser as worker_parser

from .conftest import ROOT

yaml = pytest.importorskip("yaml", reason="needs PyYAML (pip install pyyaml; kubernetes-validate brings it)")

MANIFEST = ROOT / "launch" / "kubernetes" / "flodl-job.yaml"
#: The oldest Kubernetes the recipe is checked against (backoffLimitPerIndex is on by default from 1.29).
OLDEST = "1.29.0"


def documents() -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(MANIFEST.read_text())}


def pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def container(job: dict) -> dict:
    [only] = pod(job)["containers"]
    return only


def secret_env(job: dict) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"]) for e in container(job)["env"]}


def test_the_pieces_agree_with_each_other_and_with_flodls_command_lines():
    docs = documents()
    service, controller, workers = docs["Service/flodl"], docs["Job/flodl-controller"], docs["Job/flodl-worker"]
    # the headless Service names every pod of the run: <hostname>.<subdomain>
    assert service["spec"]["clusterIP"] == "None"
    for job in (controller, workers):
        assert pod(job)["subdomain"] == service["metadata"]["name"]
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert pod(job)["restartPolicy"] == "Never"
    assert container(controller)["image"] == container(workers)["image"]

    argv = container(controller)["command"]
    assert argv[:3] == ["python", "-m", "flodl.controller"]
    launch, _ = resolve(build_parser().parse_args(argv[3:]))
    assert launch.bind == "0.0.0.0" and launch.advertise == f"{pod(controller)['hostname']}.{pod(controller)['subdomain']}"
    assert launch.port in {p["port"] for p in service["spec"]["ports"]}
    assert launch.dashboard_port in {p["containerPort"] for p in container(controller)["ports"]}

    wargv = container(workers)["command"]
    assert wargv[:3] == ["python", "-m", "flodl.worker"]
    wargs = worker_parser().parse_args(wargv[3:])
    assert wargs.controller == f"tcp://{launch.advertise}:{launch.port}"  # the workers dial what the controller advertises

    spec = workers["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == launch.workers
    # one lost worker must not take the others down: no Job-wide backoffLimit, a per-index one of 0
    assert spec["backoffLimitPerIndex"] == 0 and "backoffLimit" not in spec
    # both sides take the run's credentials from the same Secret
    assert (
        secret_env(controller)
        == secret_env(workers)
        == {
            "FLODL_RUN_SECRET": ("flodl-run", "FLODL_RUN_SECRET"),
            "FLODL_RUN_ID": ("flodl-run", "FLODL_RUN_ID"),
        }
    )


def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip install kubernetes-validate; in flodl[test])")


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_every_document_validates_against_kubernetes_schema(version):
    kv = kubernetes_validate()
    version = kv.latest_version() if version == "latest" else version
    for name, doc in documents().items():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name} is not a valid Kubernetes {version} object: {exc}")


def test_the_validator_refuses_what_kubernetes_would():
    """The check above can fail: a misspelt field and a wrong type are refused."""
    kv = kubernetes_validate()
    job = documents()["Job/flodl-worker"]
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["completionsMode"] = misspelt["spec"].pop("completionMode")
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["parallelism"] = "two"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, OLDEST, strict=True)
