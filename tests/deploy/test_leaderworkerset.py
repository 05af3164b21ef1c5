"""deploy/k8s-tp/leaderworkerset.yaml, offline: a tensor-parallel group as a LeaderWorkerSet.

The LeaderWorkerSet is a custom resource, whose schema kubernetes-validate does not bundle: its
two pod templates are validated as core PodTemplates against the official schema, the
LeaderWorkerSet fields that decide the group's behaviour are checked by name, and every
container's command line parses with pagedkv's own CLI once Kubernetes' $(VAR) expansion is
done with the ConfigMap and the variables LWS injects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pagedkv.cli import build_parser
from pagedkv.tp_cli import check_worker_args
from tests.deploy.unit_files import REPO

MANIFEST = REPO / "deploy" / "k8s-tp" / "leaderworkerset.yaml"
CONFIG_MAP = REPO / "deploy" / "k8s" / "configmap.yaml"
K8S_VERSION = "1.34.0"


def _lws() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(Path(MANIFEST).read_text()) if d]
    return doc


def _args(container: dict, index: int, size: int) -> list[str]:
    env = yaml.safe_load(CONFIG_MAP.read_text())["data"]
    env |= {"LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": str(size), "LWS_LEADER_ADDRESS": "lead.svc"}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


def test_the_group_is_recreated_together_and_the_leader_starts_first():
    lws = _lws()
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a rank's death ends its group
    assert lws["spec"]["startupPolicy"] == "LeaderCreated" and template["size"] >= 2


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_pod_templates_validate_against_the_official_schema(role):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    template = _lws()["spec"]["leaderWorkerTemplate"][role]
    doc = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": role.lower()},
        "template": template,
    }
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{role}: {e.message} at {list(e.path)}")


def test_every_rank_parses_and_meets_at_the_leaders_rendezvous():
    spec = _lws()["spec"]["leaderWorkerTemplate"]
    size, parser = spec["size"], build_parser()
    leader = {c["name"]: c for c in spec["leaderTemplate"]["spec"]["containers"]}
    (follower,) = spec["workerTemplate"]["spec"]["containers"]
    rank0 = parser.parse_args(_args(leader["worker"], 0, size))
    control = parser.parse_args(_args(leader["control"], 0, size))
    assert control.worker == rank0.listen  # the control plane sees rank 0 as its one worker
    port = next(p["containerPort"] for p in leader["worker"]["ports"] if p["name"] == "tp-rendezvous")
    assert rank0.tp_init == f"tcp://lead.svc:{port}"
    for index in range(size):
        args = parser.parse_args(_args(follower if index else leader["worker"], index, size))
        check_worker_args(args)  # rank in range, rendezvous given
        assert (args.tp_rank, args.tp_size, args.tp_init) == (index, size, rank0.tp_init)
        assert (args.model, args.block_size) == (rank0.model, rank0.block_size)  # one model
        assert args.device == "cpu"  # CPU ranks: CUDA ranks have never run on a GPU (ARCHITECTURE.md)
