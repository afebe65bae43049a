"""deploy/: each piece checked by the tool that would reject it in production, as far as this machine allows.

Kubernetes core kinds by kubernetes-validate (strict: unknown fields fail), the ServiceMonitor (a CRD it has no
schema for) structurally; the systemd unit by ``systemd-analyze verify``; the Prometheus config by ``promtool
check config`` with the rules exported the documented way; the Slurm prolog by running it against the real
``gpuwatch diagnose`` with a recording fake ``scontrol``; the Dockerfile by parsing it. Flags used in the
manifests are checked against the real CLIs' ``--help``, so a renamed flag breaks a test, not a node.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import FIXTURES, require_tool

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "gpuwatch-agent.yaml"
UNIT = DEPLOY / "systemd" / "gpuwatch-agent.service"
PROLOG = DEPLOY / "slurm" / "gpuwatch-prolog.sh"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
PROMETHEUS = DEPLOY / "prometheus"
DOCKERFILE = DEPLOY / "Dockerfile"
IB_SYSFS = FIXTURES / "procfs-infiniband" / "sys"
GPUWATCH = [sys.executable, "-m", "gpuwatch.cli.main"]
K8S_VERSION = "1.30.0"


def _help(*command: str) -> str:
    return subprocess.run([*GPUWATCH, *command, "--help"], capture_output=True, text=True, check=True).stdout


def _flags(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


# --- Kubernetes ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


@pytest.mark.parametrize("kind", ["Namespace", "DaemonSet", "Service"])
def test_core_kinds_validate_strictly(manifests, kind):
    kubernetes_validate.validate(manifests[kind], K8S_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field(manifests):
    """The check has teeth: a typo that Kubernetes would silently drop (losing the read-only root) fails."""
    broken = copy.deepcopy(manifests["DaemonSet"])
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _pod(manifests) -> dict[str, Any]:
    return manifests["DaemonSet"]["spec"]["template"]["spec"]


def _agent(manifests) -> dict[str, Any]:
    (container,) = [c for c in _pod(manifests)["containers"] if c["name"] == "agent"]
    return container


def _mounts(container) -> dict[str, dict[str, Any]]:
    return {mount["name"]: mount for mount in container.get("volumeMounts", [])}


def test_daemonset_reads_host_sys_read_only_and_shares_the_socket_directory(manifests):
    pod, agent = _pod(manifests), _agent(manifests)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = _mounts(agent)
    assert volumes["sys"]["hostPath"]["path"] == "/sys" and mounts["sys"]["readOnly"] is True
    args = dict(arg.split("=", 1) for arg in agent["args"])
    assert args["--sysfs-root"] == mounts["sys"]["mountPath"]
    socket_dir = str(Path(args["--telemetry.socket"]).parent)
    assert mounts["telemetry"]["mountPath"] == socket_dir
    assert volumes["telemetry"]["hostPath"]["path"] == socket_dir   # same path on the host as in the training pods
    assert not mounts["telemetry"].get("readOnly")


def test_daemonset_flags_are_real_agent_flags(manifests):
    help_text = _help("agent")
    for flag in _flags(_agent(manifests)["args"]):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{flag} is not a gpuwatch agent flag"


def test_daemonset_gets_every_gpu_without_allocating_one(manifests):
    """dcgm-exporter's way: the nvidia runtime class and NVIDIA_VISIBLE_DEVICES=all, no nvidia.com/gpu request
    (which would take GPUs away from training pods)."""
    pod, agent = _pod(manifests), _agent(manifests)
    assert pod["runtimeClassName"] == "nvidia"
    env = {item["name"]: item.get("value") for item in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    for bound in agent["resources"].values():
        assert "nvidia.com/gpu" not in bound


def test_daemonset_runs_non_root_read_only_with_bounded_resources(manifests):
    pod, agent = _pod(manifests), _agent(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    context = agent["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
    assert set(agent["resources"]["requests"]) == set(agent["resources"]["limits"]) == {"cpu", "memory"}
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9746, "protocol": "TCP"}]


def test_init_container_hands_the_socket_directory_to_the_agent_user(manifests):
    pod = _pod(manifests)
    (init,) = pod["initContainers"]
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    assert f"chown {uid}:{gid} /run/gpuwatch" in init["command"][-1]
    assert "chmod 0750" in init["command"][-1]   # the agent refuses a group/other-writable socket directory
    assert set(init["securityContext"]["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}
    assert _mounts(init)["telemetry"]["mountPath"] == "/run/gpuwatch"


def test_service_and_service_monitor_select_the_agent_pods(manifests):
    pod_labels = manifests["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service, monitor = manifests["Service"], manifests["ServiceMonitor"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None"
    assert {port["name"] for port in service["spec"]["ports"]} == {"metrics"}
    # ServiceMonitor: a CRD kubernetes-validate has no schema for, so checked field by field.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": monitor["metadata"]},
                                 K8S_VERSION, strict=True)
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert spec["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True   # else the training job's label becomes exported_job
    assert {"targetLabel": "job", "replacement": "gpuwatch", "action": "replace"} in endpoint["relabelings"]
    known = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings"}
    assert set(endpoint) <= known


TLS = DEPLOY / "kubernetes" / "tls"


def _json_patch(document: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, the only operation the TLS patches use, as ``kubectl patch --type=json`` applies it."""
    patched = copy.deepcopy(document)
    for operation in operations:
        assert operation["op"] == "add", operation
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        target = patched
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), operation["value"])
        else:
            target[last] = operation["value"]
    return patched


def test_tls_patch_keeps_the_daemonset_valid_and_mounts_the_web_config(manifests):
    daemonset = _json_patch(manifests["DaemonSet"], yaml.safe_load((TLS / "daemonset-patch.yaml").read_text()))
    kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)
    pod = daemonset["spec"]["template"]["spec"]
    (agent,) = [c for c in pod["containers"] if c["name"] == "agent"]
    web_config = Path(dict(arg.split("=", 1) for arg in agent["args"])["--web.config.file"])
    mount = _mounts(agent)["web"]
    assert mount["readOnly"] is True and web_config.parent == Path(mount["mountPath"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == "web"]
    files = {item["path"] for source in volume["projected"]["sources"] for item in source["secret"]["items"]}
    assert files == {web_config.name, "tls.crt", "tls.key"}   # the relative names in web-config.yml resolve
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]   # the 0440 key is readable
    for probe in ("readinessProbe", "livenessProbe"):
        assert agent[probe]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}
    help_text = _help("agent")
    assert all(re.search(rf"{re.escape(flag)}\b", help_text) for flag in _flags(agent["args"]))


def test_tls_patch_makes_the_service_monitor_scrape_https_with_basic_auth(manifests):
    monitor = _json_patch(manifests["ServiceMonitor"],
                          yaml.safe_load((TLS / "servicemonitor-patch.yaml").read_text()))
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "gpuwatch-tls", "key": "ca.crt"}
    assert set(endpoint["basicAuth"]) == {"username", "password"}


def test_shipped_web_config_loads_beside_its_certificates_and_fails_closed(tmp_path):
    from test_webconfig import write_pki

    from gpuwatch.agent import webconfig

    write_pki(tmp_path)
    shutil.copy(TLS / "web-config.yml", tmp_path / "web-config.yml")
    config = webconfig.load(tmp_path / "web-config.yml")
    assert config.tls is not None and config.tls.minimum_version == webconfig.TLS_VERSIONS["TLS12"]
    guess = "Basic " + base64.b64encode(b"prometheus:prometheus").decode()
    assert config.auth is not None and not config.auth.check(guess)


# --- systemd ------------------------------------------------------------------------------------------------------

def _verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``systemd-analyze verify`` on a copy whose ExecStart names this machine's gpuwatch (verify checks that the
    binary exists). It runs without systemd as PID 1: it parses the unit and its directives."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    gpuwatch = shutil.which("gpuwatch")
    assert gpuwatch, "the gpuwatch console script is not installed (pip install -e .)"
    unit = tmp_path / "gpuwatch-agent.service"
    unit.write_text(unit_text.replace("/opt/gpuwatch/bin/gpuwatch", gpuwatch))
    return subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_systemd_unit_verifies(tmp_path):
    result = _verify(UNIT.read_text(), tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.integration
def test_systemd_verify_rejects_a_misspelt_directive(tmp_path):
    """The check has teeth: a misspelt hardening directive (silently ignored by systemd at runtime) is reported."""
    broken = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict")
    result = _verify(broken, tmp_path)
    assert "Unknown key 'ProtectSytem'" in result.stderr


def test_systemd_unit_is_hardened_and_admits_nvidia_devices():
    directives: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            directives.setdefault(key, []).append(value)
    expected = {"DynamicUser": "yes", "ProtectSystem": "strict", "NoNewPrivileges": "yes", "DevicePolicy": "closed",
                "RuntimeDirectory": "gpuwatch", "RuntimeDirectoryMode": "0750"}
    for key, value in expected.items():
        assert directives[key] == [value], key
    assert directives["CapabilityBoundingSet"] == [""]
    assert "PrivateDevices" not in directives   # would hide /dev/nvidia*
    assert {"/dev/nvidiactl rw", "char-nvidia-frontend rw"} <= set(directives["DeviceAllow"])
    exec_start = shlex.split(directives["ExecStart"][0])
    assert exec_start[1] == "agent"
    assert "--telemetry.socket" in exec_start
    assert exec_start[exec_start.index("--telemetry.socket") + 1] == "/run/gpuwatch/telemetry.sock"
    help_text = _help("agent")
    for flag in _flags(exec_start):
        assert flag in help_text


# --- Slurm --------------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_scontrol(tmp_path) -> Path:
    """A ``scontrol`` on PATH that records its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "scontrol.args"}\n')
    script.chmod(0o755)
    return tmp_path / "scontrol.args"


def _prolog(fake_scontrol: Path, **env: str) -> subprocess.CompletedProcess:
    base = {key: value for key, value in os.environ.items() if not key.startswith("NCCL_")}
    # The real gpuwatch of this interpreter, first on PATH, then the fake scontrol's directory.
    path = os.pathsep.join([str(fake_scontrol.parent / "bin"), str(Path(sys.executable).parent), base["PATH"]])
    env = {**base, "PATH": path, "SLURMD_NODENAME": "gpu-17", "GPUWATCH_SYSFS_ROOT": str(IB_SYSFS), **env}
    return subprocess.run(["bash", str(PROLOG)], capture_output=True, text=True, env=env, timeout=120)


def test_prolog_drains_the_node_with_the_finding_as_reason(fake_scontrol):
    result = _prolog(fake_scontrol, NCCL_IB_DISABLE="1")
    assert result.returncode == 1, result.stderr   # Slurm requeues the job elsewhere
    args = fake_scontrol.read_text().splitlines()
    assert args[:3] == ["update", "nodename=gpu-17", "state=drain"]
    (reason,) = args[3:]
    assert reason.startswith("reason=gpuwatch: NCCL001: NCCL_IB_DISABLE=1 while 4 InfiniBand/RoCE port(s)")
    assert len(reason) <= len("reason=gpuwatch: ") + 200
    assert "draining: NCCL001" in result.stderr


def test_prolog_reads_the_site_environment_file(fake_scontrol, tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("NCCL_IB_DISABLE=1\n")
    result = _prolog(fake_scontrol, GPUWATCH_PROLOG_ENV=str(env_file))
    assert result.returncode == 1 and "NCCL001" in fake_scontrol.read_text()


def test_prolog_passes_a_healthy_node(fake_scontrol):
    result = _prolog(fake_scontrol, NCCL_IB_DISABLE="0")
    assert result.returncode == 0, result.stderr
    assert not fake_scontrol.exists()


def test_prolog_never_blocks_jobs_when_diagnose_cannot_run(fake_scontrol):
    result = _prolog(fake_scontrol, NCCL_IB_DISABLE="1", GPUWATCH="/nonexistent/gpuwatch")
    assert result.returncode == 0
    assert not fake_scontrol.exists()
    assert "not draining" in result.stderr


def test_sbatch_example_is_valid_bash_with_real_trainer_flags():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    command = " ".join(line.rstrip("\\") for line in text.split("srun", 1)[1].split("\n\n")[0].splitlines())
    torchrun, trainer = command.split("-m gpuwatch.trainer.cli")
    trainer_flags = _flags(shlex.split(trainer))
    assert {"--telemetry-socket", "--job", "--tp", "--pp", "--dp"} <= trainer_flags
    help_text = _help("train")
    for flag in trainer_flags:
        assert flag in help_text, f"{flag} is not a gpuwatch train flag"
    assert "--nproc-per-node" in torchrun and "GPUWATCH_SOCKET=/run/gpuwatch/telemetry.sock" in text


# --- Prometheus ---------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_prometheus_config_with_exported_rules_passes_promtool(tmp_path):
    config_dir = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, config_dir)
    subprocess.run([*GPUWATCH, "alerts", "export", str(config_dir / "rules")], check=True, capture_output=True)
    result = subprocess.run([require_tool("promtool"), "check", "config", str(config_dir / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout
    found = re.search(r"SUCCESS: (\d+) rules found", result.stdout)
    assert found and int(found.group(1)) > 0


def test_prometheus_scrape_job_honours_labels():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "gpuwatch" and job["honor_labels"] is True
    for pattern in job["file_sd_configs"][0]["files"]:
        assert list(PROMETHEUS.glob(pattern)), f"no example target file matches {pattern}"


# --- Dockerfile ---------------------------------------------------------------------------------------------------

def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_installs_the_agent_without_torch_and_runs_non_root():
    instructions = _instructions()
    kinds = [kind for kind, _ in instructions]
    assert re.fullmatch(r"python:3\.\d+-slim", dict(instructions)["FROM"])
    runs = " ".join(args for kind, args in instructions if kind == "RUN")
    assert "pip install ." in runs
    assert "torch" not in runs and "[trainer" not in runs
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    assert ("EXPOSE", "9746") in instructions
    assert ("ENTRYPOINT", '["gpuwatch", "agent"]') in instructions


def test_dockerfile_copies_what_the_package_needs():
    root = DOCKERFILE.parent.parent
    pyproject = (root / "pyproject.toml").read_text()
    for kind, args in _instructions():
        if kind == "COPY":
            for source in args.split()[:-1]:
                assert (root / source).exists(), source
    copied = " ".join(args for kind, args in _instructions() if kind == "COPY")
    for folder in re.findall(r'"gpuwatch\.\w+" = "(\w+)"', pyproject):   # every package-dir of the package
        assert f"{folder} " in copied + " ", f"{folder}/ is not copied into the image"
    ignored = {line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line and not line.startswith("#")}
    for kind, args in _instructions():
        if kind == "COPY":
            assert not set(args.split()[:-1]) & ignored, "the build context leaves out what COPY needs"
