"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object validates strictly (no
unknown fields) against the Kubernetes OpenAPI schemas of kubernetes-validate, and the objects do what the
design needs: the KeysManager and the stage pods share the same host folders, the gateway password is a
file, the ConfigMaps hold real settings names. No cluster runs here (docs/kubernetes.md)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import fields

import pytest
import yaml
from gateway_plugin.config import PluginConfig
from gateway_plugin.kubernetes_pods import KubernetesAPI, PodDirectory, pod_directory
from gateway_plugin.standalone import DEFAULT_NAMESPACE
from quart_stage.config import StageConfig
from quart_stage.settings import ConfigError
from quart_tools.stackfile import stack_document
from support.paths import REPO

from keysmanager.config import KeysManagerConfig
from keysmanager.replicas import replica_socket_path

ROOT = str(REPO)
KUBE = os.path.join(ROOT, "deploy", "kubernetes")
DOCKER = os.path.join(ROOT, "deploy", "docker")
OVERLAYS = sorted(os.listdir(os.path.join(KUBE, "overlays")))
# MutatingAdmissionPolicy is admissionregistration.k8s.io/v1 from 1.36 on: the oldest version the overlays
# (with the stage-node-cache component) apply to; the newest kubernetes-validate knows is checked as well.
KUBERNETES_VERSIONS = ("1.36.0", "1.37.0")
SOCKET_VOLUME, SHM_VOLUME = "quart-km-socket", "quart-km-shm"
NODE_CACHE_POLICY, GPU_POLICY = "quart-stage-node-cache", "quart-stage-gpu"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered")
    out = subprocess.run(["kubectl", "kustomize", os.path.join(KUBE, "overlays", overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objects: tuple[dict, ...], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def configmap(objects: tuple[dict, ...], container: dict) -> dict[str, str]:
    """The data of the (hash-suffixed) ConfigMap a container reads with envFrom."""
    [ref] = [e["configMapRef"]["name"] for e in container.get("envFrom", [])]
    return one(objects, "ConfigMap", ref)["data"]


def pod_spec(objects: tuple[dict, ...], kind: str) -> dict:
    return one(objects, kind)["spec"]["template"]["spec"]


def stage_pod_patch(objects: tuple[dict, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """(volume → hostPath, volume → mountPath) that the admission policy adds to stage pods."""
    policy = one(objects, "MutatingAdmissionPolicy", NODE_CACHE_POLICY)
    [expr] = [m["jsonPatch"]["expression"] for m in policy["spec"]["mutations"]]
    host = dict(re.findall(r'name: "([\w-]+)",\s*hostPath: Object\.spec\.volumes\.hostPath\{path: "([^"]+)"', expr))
    mounts = dict(re.findall(r'name: "([\w-]+)", mountPath: "([^"]+)"', expr))
    return host, mounts


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_every_overlay_validates_strictly(overlay: str, version: str):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render(overlay)
    assert {o["kind"] for o in objects} == {"ServiceAccount", "ConfigMap", "Service", "Deployment", "DaemonSet",
                                            "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "Namespace",
                                            "Role", "RoleBinding"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any unknown or mistyped field


def test_strict_validation_rejects_an_unknown_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    daemonset = yaml.safe_load(yaml.safe_dump(one(render("gpu"), "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["hostPathMount"] = "/run/quart"
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPathMount"):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespaces_are_openfaas_ones(overlay: str):
    objects = render(overlay)
    for obj in objects:
        if obj["kind"] in ("Role", "RoleBinding"):  # the plugin's read access to the functions' EndpointSlices
            assert obj["metadata"]["namespace"] == "openfaas-fn", obj["metadata"]["name"]
        elif not obj["kind"].startswith("MutatingAdmissionPolicy") and obj["kind"] != "Namespace":  # cluster-scoped
            assert obj["metadata"]["namespace"] == "openfaas", obj["metadata"]["name"]
    # the stage pods' hostPath mounts are refused under Pod Security baseline: their namespace is privileged
    [namespace] = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == "openfaas-fn"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    policies = [o for o in objects if o["kind"] == "MutatingAdmissionPolicy"]
    bindings = {o["spec"]["policyName"] for o in objects if o["kind"] == "MutatingAdmissionPolicyBinding"}
    assert bindings == {p["metadata"]["name"] for p in policies}  # every policy is bound
    for policy in policies:  # only stage pods in the functions' namespace, never OpenFaaS's own pods
        match = policy["spec"]["matchConstraints"]
        assert match["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "openfaas-fn"}
        assert match["objectSelector"]["matchExpressions"] == [{"key": "com.quart.model", "operator": "Exists"}]
        assert policy["spec"]["failurePolicy"] == "Ignore"  # a pod left unpatched still starts (cold path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keysmanager_and_stage_pods_mount_the_same_host_folders_at_the_same_paths(overlay: str):
    objects = render(overlay)
    spec = pod_spec(objects, "DaemonSet")
    [km] = spec["containers"]
    km_host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    km_mounts = {m["name"]: m["mountPath"] for m in km["volumeMounts"]}
    stage_host, stage_mounts = stage_pod_patch(objects)
    assert set(stage_host) == set(stage_mounts) == {SOCKET_VOLUME, SHM_VOLUME}
    for volume in (SOCKET_VOLUME, SHM_VOLUME):
        # same host folder, same path inside both containers: a segment path the KeysManager reports is valid
        # in the stage pod as it is
        km_volume = {v for v, p in km_host.items() if p == stage_host[volume]}
        assert len(km_volume) == 1, f"the DaemonSet does not mount {stage_host[volume]}"
        assert km_mounts[km_volume.pop()] == stage_mounts[volume]
    assert stage_host[SHM_VOLUME].startswith("/dev/shm/")  # the node's tmpfs: memory, never disk
    config = KeysManagerConfig.from_env({**configmap(objects, km), "KM_NAME": "node-a"})
    assert os.path.dirname(config.socket_path) == stage_mounts[SOCKET_VOLUME]
    assert config.shm_dir == stage_mounts[SHM_VOLUME]
    policy = one(objects, "MutatingAdmissionPolicy", NODE_CACHE_POLICY)
    [expr] = [m["jsonPatch"]["expression"] for m in policy["spec"]["mutations"]]
    stage_env = dict(re.findall(r'env\{\s*name: "(\w+)", value: "([^"]+)"', expr))
    # the stage asks this socket; of-watchdog starts the fork path (quart_stage.forward), which falls back to gunicorn
    assert stage_env == {"QUART_KEYSMANAGER_SOCKET": str(config.socket_path), "fprocess": "python -m quart_stage.forward"}
    assert os.path.exists(os.path.join(ROOT, "template", "pipeline-stage", "quart_stage", "forward.py"))
    # forked replicas' Unix sockets lie inside the folder the stage pod mounts, at the same path
    assert replica_socket_path(config.socket_path, "f-1a2b3c4d").parent.parent.as_posix() == stage_mounts[SOCKET_VOLUME]
    assert config.state_path.as_posix() in {m["mountPath"] for m in km["volumeMounts"]}
    assert config.gpus == 0 and not config.pin_cpus  # GPUs and cores belong to the kubelet on a cluster
    [init] = spec["initContainers"]  # hostPath folders are made root-owned: handed to the agent's uid first
    assert str(spec["securityContext"]["runAsUser"]) in init["command"]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {stage_mounts[SOCKET_VOLUME], stage_mounts[SHM_VOLUME]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_password_is_a_secret_file_not_an_environment_variable(overlay: str):
    objects = render(overlay)
    spec = pod_spec(objects, "Deployment")
    [plugin] = spec["containers"]
    assert all("valueFrom" not in e for e in plugin.get("env", []))
    assert all("secretRef" not in e for e in plugin.get("envFrom", []))
    [secret_volume] = [v for v in spec["volumes"] if "secret" in v]
    secret = secret_volume["secret"]
    assert secret["secretName"] == "basic-auth"  # the OpenFaaS helm chart's credentials
    assert secret["defaultMode"] in (0o400, 0o600)
    [mount] = [m for m in plugin["volumeMounts"] if m["name"] == secret_volume["name"]]
    assert mount["readOnly"] is True
    [item] = secret["items"]
    assert item["key"] == "basic-auth-password"
    config = PluginConfig.from_env(configmap(objects, plugin))
    assert config.gateway_password_file == f"{mount['mountPath']}/{item['path']}"
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]  # uid can read 0400


def _read_by(cls_from_env, key: str) -> bool:
    """Whether ``from_env`` reads variable ``key``: a probe value shows up in a field or fails to parse."""
    probe = "quart-probe-7"
    try:
        config = cls_from_env({key: probe})
    except (ConfigError, ValueError) as exc:
        return key in str(exc) or "probe" in str(exc)
    return any(getattr(config, f.name) == probe for f in fields(config))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmap_keys_are_real_settings_names(overlay: str):
    objects = render(overlay)
    [plugin] = pod_spec(objects, "Deployment")["containers"]
    plugin_settings = configmap(objects, plugin)
    for key in plugin_settings:
        assert _read_by(PluginConfig.from_env, key), f"PluginConfig does not read {key}"
    config = PluginConfig.from_env(plugin_settings)  # every value parses
    assert config.actuator == "rest"  # the standalone plugin scales through the gateway's REST API
    assert config.gateway_url.startswith("http://gateway.openfaas.")
    [km] = pod_spec(objects, "DaemonSet")["containers"]
    km_names = {f"KM_{f.name.upper()}" for f in fields(KeysManagerConfig)}
    km_settings = configmap(objects, km)
    assert set(km_settings) | {e["name"] for e in km["env"]} <= km_names
    KeysManagerConfig.from_env({**km_settings, "KM_NAME": "node-a"})


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_and_node_placement(overlay: str):
    objects = render(overlay)
    for kind in ("Deployment", "DaemonSet"):
        spec = pod_spec(objects, kind)
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]
    spec = pod_spec(objects, "DaemonSet")
    [km] = spec["containers"]
    # the segments are tmpfs pages charged to the KeysManager's cgroup: its limit must hold them and more
    assert _bytes(km["resources"]["limits"]["memory"]) > int(configmap(objects, km)["KM_MEMORY_LIMIT"])
    if overlay == "gpu":
        assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert GPU_TOLERATION in spec["tolerations"]
        assert "nvidia.com/gpu" not in km["resources"]["limits"]  # stage pods hold the GPUs, not the agent
    else:
        assert "nvidia.com/gpu.present" not in spec["nodeSelector"] and "tolerations" not in spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_the_plugin(overlay: str):
    objects = render(overlay)
    deployment = one(objects, "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    [plugin] = deployment["spec"]["template"]["spec"]["containers"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == plugin["ports"][0]["containerPort"]
    assert plugin["args"][plugin["args"].index("--port") + 1] == annotations["prometheus.io/port"]
    service = one(objects, "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_plugin_reads_the_kubernetes_api_and_only_the_functions_endpointslices(overlay: str):
    """The plugin addresses stage pods directly (QUART_PLATFORM=kubernetes): its service account may get, list and
    watch endpointslices in the functions' namespace, at the API path its pod directory calls; nothing else has a
    role or a token."""
    objects = render(overlay)
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    [rule] = role["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}
    functions_namespace = one(objects, "Namespace")["metadata"]["name"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == functions_namespace == DEFAULT_NAMESPACE
    # the path the pod directory lists and watches is the one the rule grants
    path = KubernetesAPI("https://k8s", "/sa")._path(functions_namespace)
    assert path == f"https://k8s/apis/{rule['apiGroups'][0]}/v1/namespaces/{functions_namespace}/{rule['resources'][0]}"
    deployment = one(objects, "Deployment")
    account = one(objects, "ServiceAccount", deployment["spec"]["template"]["spec"]["serviceAccountName"])
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert pod_spec(objects, "Deployment")["automountServiceAccountToken"] is True  # its token and the cluster CA
    assert pod_spec(objects, "DaemonSet")["automountServiceAccountToken"] is False
    [plugin] = pod_spec(objects, "Deployment")["containers"]
    config = PluginConfig.from_env(configmap(objects, plugin))
    assert config.platform == "kubernetes" and isinstance(pod_directory(config), PodDirectory)
    assert config.kubernetes_credentials_dir == "/var/run/secrets/kubernetes.io/serviceaccount"  # where it is mounted


@pytest.mark.parametrize("component,module", [("plugin", "gateway_plugin.standalone"),
                                              ("keysmanager", "keysmanager.daemon")])
def test_images_are_built_from_this_repository_as_non_root(component: str, module: str):
    images = {c["image"] for o in OVERLAYS for kind in ("Deployment", "DaemonSet")
              for c in pod_spec(render(o), kind)["containers"]}
    assert f"ghcr.io/quart-faas/{component}:0.1.0" in images
    text = open(os.path.join(DOCKER, f"{component}.Dockerfile"), encoding="utf-8").read()
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in {"root", "0"}
    assert f'ENTRYPOINT ["python", "-m", "{module}"]' in text
    assert importlib.util.find_spec(module) is not None
    for source in re.findall(r"^COPY (?!--from)(?:--\S+ )?(\S+(?: \S+)*) \S+$", text, re.M):
        for path in source.split():
            assert os.path.exists(os.path.join(ROOT, path)), f"{component}.Dockerfile copies missing {path}"


def test_cuda_stage_pods_get_a_gpu_and_the_gpu_nodes_toleration_in_the_gpu_overlay(tmp_path):
    assert not [o for o in render("cpu") if o["metadata"]["name"] == GPU_POLICY]
    policy = one(render("gpu"), "MutatingAdmissionPolicy", GPU_POLICY)["spec"]
    conditions = " ".join(c["expression"] for c in policy["matchConditions"])
    # selects by the stage runtime's own setting, with the value `quartctl partition --compute cuda` writes
    [(variable, value)] = re.findall(r"e\.name == '(\w+)' && has\(e\.value\) && e\.value == '(\w+)'", conditions)
    assert StageConfig.from_env({variable: value, "QUART_MODEL_DIR": str(tmp_path)}).compute == value
    doc = stack_document("m", "decoder", 1, str(tmp_path), compute="cuda")
    assert doc["functions"]["m-stage-0"]["environment"][variable] == value
    [expr] = [m["jsonPatch"]["expression"] for m in policy["mutations"]]
    assert '"/spec/containers/0/resources/limits/" + jsonpatch.escapeKey("nvidia.com/gpu")' in expr
    toleration = re.search(r"Object\.spec\.tolerations\{\s*(.*?)\}", expr, re.S).group(1)
    assert dict(re.findall(r'(\w+): "([^"]+)"', toleration)) == GPU_TOLERATION  # the DaemonSet's toleration
