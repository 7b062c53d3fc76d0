"""Deployment files: every YAML parses, every `bertforge` command line written in infra/ and the
README parses with the real CLI, the KubeRay and launcher files have what they need, nothing
holds a credential, and a local Ray listens on the loopback address only."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bertforge.cluster.cli import build_parser
from tests.support.train_process import LOOPBACK, listening_sockets
from tests.test_packaging import FOLDERS, SOURCES

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
README = ROOT / "README.md"
YAML_FILES = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
INFRA_FILES = sorted(p for p in INFRA.rglob("*") if p.is_file())
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ">", ">>", "<", "2>"}
# A `bertforge` token starts a command here: line start, after a separator, `--` (`ray job
# submit -- bertforge ...`, `bertforge submit -- bertforge ...`), `exec`, or NAME=VALUE.
COMMAND_PREFIXES = SEPARATORS | {"--", "exec", "then", "do", "time"}


def _load_all(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _logical_lines(text: str) -> list[str]:
    """Lines with `\\` continuations joined."""
    lines, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            lines.append(current + line)
            current = ""
    if current:
        lines.append(current)
    return lines


def _commands_in_line(line: str) -> list[list[str]]:
    """Every `bertforge ...` command in one shell line, as argv lists (without `bertforge`)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError:  # prose with an apostrophe, not a shell line
        return [] if "bertforge" not in line else [["<unparseable>", line]]
    commands = []
    for i, token in enumerate(tokens):
        if token != "bertforge":
            continue
        before = tokens[i - 1] if i else None
        if before is None or before in COMMAND_PREFIXES or re.fullmatch(r"\w+=\S*", before):
            argv = []
            for arg in tokens[i + 1 :]:
                if arg in SEPARATORS or arg.startswith("#"):  # a shell comment ends the line
                    break
                argv.append(arg)
            commands.append(argv)
    return commands


def _commands_in_text(text: str, *, comments_only: bool = False) -> list[list[str]]:
    """Commands in shell-like text; `#` comment markers are dropped (usage examples live there)."""
    lines = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#"):
            lines.append(stripped.lstrip("#"))
        elif not comments_only:
            lines.append(line)
        else:
            lines.append("")
    return [c for line in _logical_lines("\n".join(lines)) for c in _commands_in_line(line)]


def _strings(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in _strings(key) + _strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return []


def _readme_code_blocks() -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def _all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in INFRA_FILES:
        where = str(path.relative_to(ROOT))
        text = path.read_text(encoding="utf-8")
        if path in YAML_FILES:
            # Values (entrypoints, start commands) as YAML reads them, plus comment examples.
            for doc in _load_all(path):
                for value in _strings(doc):
                    if value.strip() == "bertforge":  # a name (cluster, label), not a command
                        continue
                    found += [(where, argv) for argv in _commands_in_text(value)]
            found += [(where, argv) for argv in _commands_in_text(text, comments_only=True)]
        elif path.suffix not in (".json",):
            found += [(where, argv) for argv in _commands_in_text(text)]
    for block in _readme_code_blocks():
        found += [("README.md", argv) for argv in _commands_in_text(block)]
    return found


def _check_command(argv: list[str]) -> None:
    """Parse like `bertforge.cluster.cli.main` does; `prepare` flags go through the Beam
    job's checks."""
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, extra = parser.parse_known_args(argv)
    except SystemExit as error:
        if error.code == 0:  # --help
            return
        raise AssertionError(f"bertforge {' '.join(argv)}: {err.getvalue().strip()}") from error
    if args.command == "prepare":
        from bertforge.pipelines.prepare_options import parse_command_line

        parse_command_line(extra)  # the job's and Beam's flags, required ones, value ranges
    else:
        assert not extra, f"bertforge {' '.join(argv)}: unrecognized arguments {extra}"


# --- YAML -------------------------------------------------------------------------------------


def test_infra_has_the_deployment_files():
    names = {str(p.relative_to(INFRA)) for p in INFRA_FILES}
    for expected in ("ray/cluster-gcp.yaml", "ray/cluster-aws.yaml", "kubernetes/raycluster.yaml",
                     "kubernetes/rayjob.yaml", "kubernetes/pvc.yaml", "docker/train.Dockerfile",
                     "dataflow/Dockerfile"):
        assert expected in names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_file_parses(path):
    docs = _load_all(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


# --- command lines ----------------------------------------------------------------------------


def test_command_lines_are_found():
    """The scanner itself: continuations, nesting after `--`, prose left alone."""
    text = ("# bertforge train --data d \\\n#   --run-dir r\n"
            "ray job submit -- bertforge train --data a --run-dir b && echo done\n"
            "this installs bertforge into the venv\n")
    assert _commands_in_text(text) == [
        ["train", "--data", "d", "--run-dir", "r"], ["train", "--data", "a", "--run-dir", "b"],
    ]
    with pytest.raises(AssertionError, match="--bogus"):
        _check_command(["train", "--data", "d", "--run-dir", "r", "--bogus"])
    with pytest.raises(AssertionError, match="required"):
        _check_command(["train", "--resume", "auto"])


def test_every_bertforge_command_line_parses_with_the_real_cli():
    commands = _all_commands()
    where = {w for w, _ in commands}
    # The examples this test exists for must be seen, or it checks nothing.
    assert {"README.md", "infra/kubernetes/rayjob.yaml", "infra/ray/cluster-gcp.yaml",
            "infra/ray/cluster-aws.yaml", "infra/kubernetes/raycluster.yaml"} <= where
    assert any(argv[:1] == ["submit"] for _, argv in commands)
    assert any(argv[:1] == ["prepare"] for _, argv in commands)
    failures = []
    for source, argv in commands:
        try:
            _check_command(argv)
        except (AssertionError, ValueError) as error:
            failures.append(f"{source}: {error}")
    assert not failures, "\n".join(failures)


def test_readme_cluster_training_resumes():
    section = README.read_text(encoding="utf-8").split("## On a Ray cluster", 1)[1]
    section = section.split("\n## ", 1)[0]
    trains = []
    for subsection in section.split("\n### "):
        # The clouds' clusters are GPU nodes; one's own machines trained here on their CPUs.
        on_gpus = not subsection.startswith("Your own machines")
        trains += [(argv, on_gpus)
                   for block in re.findall(r"```[^\n]*\n(.*?)```", subsection, re.S)
                   for argv in _commands_in_text(block) if argv[:1] == ["train"]]
    assert len(trains) >= 2
    for argv, on_gpus in trains:
        args = build_parser().parse_args(argv)
        assert args.resume == "auto" and args.address and bool(args.gpu) == on_gpus


# --- KubeRay ----------------------------------------------------------------------------------


def _kube_docs() -> dict[str, dict]:
    docs = {}
    for path in YAML_FILES:
        if "kubernetes" in path.parts:
            for doc in _load_all(path):
                assert {"apiVersion", "kind", "metadata"} <= set(doc), path
                docs[doc["kind"]] = doc
    return docs


def _pod_specs(cluster_spec: dict) -> list[dict]:
    head = cluster_spec["headGroupSpec"]["template"]["spec"]
    return [head] + [g["template"]["spec"] for g in cluster_spec["workerGroupSpecs"]]


def test_rayjob_trains_with_resume_on_a_gpu_cluster():
    docs = _kube_docs()
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    entrypoint = shlex.split(spec["entrypoint"])
    assert entrypoint[:2] == ["bertforge", "train"]
    assert "--resume auto" in " ".join(entrypoint)
    args = build_parser().parse_args(entrypoint[1:])
    assert args.resume == "auto" and args.gpu and args.address == "auto"
    assert args.run_dir.startswith("/shared/") and args.data.startswith("/shared/")
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["backoffLimit"] >= 1  # a failed attempt is resubmitted (and resumes)
    # Enough GPUs for the workers it asks for, one per worker.
    gpus = sum(g["replicas"] * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in spec["rayClusterSpec"]["workerGroupSpecs"]
               for c in g["template"]["spec"]["containers"])
    assert gpus >= args.workers
    # The standalone cluster is the same cluster.
    assert docs["RayCluster"]["apiVersion"] == "ray.io/v1"
    assert docs["RayCluster"]["spec"] == spec["rayClusterSpec"]


def test_every_ray_pod_mounts_the_shared_read_write_many_claim():
    docs = _kube_docs()
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for cluster_spec in (docs["RayCluster"]["spec"], docs["RayJob"]["spec"]["rayClusterSpec"]):
        assert cluster_spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
        images = set()
        for pod in _pod_specs(cluster_spec):
            volumes = {v["name"]: v for v in pod["volumes"]}
            for container in pod["containers"]:
                images.add(container["image"])
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                volume = volumes[mounts["/shared"]]
                assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
            assert pod["securityContext"]["runAsNonRoot"] is True
        assert len(images) == 1 and next(iter(images)).endswith("/bertforge/train:0.1.0")


# --- Ray cluster launcher ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cluster-gcp.yaml", "cluster-aws.yaml"])
def test_launcher_config_is_valid_with_a_gpu_worker_and_a_private_dashboard(name):
    from ray.autoscaler._private.util import validate_config

    (config,) = _load_all(INFRA / "ray" / name)
    validate_config(config)  # Ray's own schema for `ray up`
    assert config["head_node_type"] in config["available_node_types"]
    workers = [t for n, t in config["available_node_types"].items()
               if n != config["head_node_type"]]
    gpu_types = ("a2-", "a3-", "g5.", "g6.", "p4d.", "p5.")
    assert any(t["resources"].get("GPU") or str(
        t["node_config"].get("machineType", t["node_config"].get("InstanceType"))
    ).startswith(gpu_types) for t in workers)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in (INFRA / "ray" / name).read_text()
    assert "-v /shared:/shared" in config["docker"]["run_options"]
    assert any("/shared" in c for c in config["initialization_commands"])
    # Ray gives only the head credentials: the workers pull the private image and write
    # --storage with the head's account or role, named on them.
    for worker in workers:
        if name == "cluster-gcp.yaml":
            (account,) = worker["node_config"]["serviceAccounts"]
            assert account["email"].startswith("ray-autoscaler-sa-v1@")
            assert "https://www.googleapis.com/auth/cloud-platform" in account["scopes"]
        else:
            assert worker["node_config"]["IamInstanceProfile"]["Arn"].endswith(
                ":instance-profile/ray-autoscaler-v1")
    registry_login = ("gcloud auth configure-docker" if name == "cluster-gcp.yaml"
                      else "docker login")
    assert any(registry_login in c for c in config["initialization_commands"])


# --- images and secrets -----------------------------------------------------------------------

DOCKERFILES = {"dataflow": INFRA / "dataflow" / "Dockerfile",
               "train": INFRA / "docker" / "train.Dockerfile"}


def _instructions(path: Path, name: str) -> list[list[str]]:
    """The arguments of every `NAME ...` instruction (continuations joined)."""
    return [shlex.split(line)[1:] for line in _logical_lines(path.read_text())
            if line.startswith(name + " ")]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_images_install_the_package_bertforge_and_check_it(kind):
    dockerfile = DOCKERFILES[kind]
    text = dockerfile.read_text()
    copied = {source for args in _instructions(dockerfile, "COPY")
              for source in [a for a in args if not a.startswith("--")][:-1]}
    # The whole context, which the .dockerignore limits to the files a wheel is built from
    # (tests/test_packaging.py builds one from exactly these).
    assert "." in copied
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("**") + 1:] == [
        *(f"!{s}/**" if (ROOT / s).is_dir() else f"!{s}" for s in SOURCES),
        *(["!infra/dataflow/launch_prepare.py"] if kind == "dataflow" else []),
        "**/__pycache__", "**/*.pyc"]
    for source in SOURCES:
        assert f"!{source}" in ignore or f"!{source}/**" in ignore, (dockerfile.name, source)
    env = [arg for args in _instructions(dockerfile, "ENV") for arg in args]
    assert not any("PYTHONPATH" in arg for arg in env)  # the installed package is what runs
    # The build's import check names modules of the package, and they exist.
    checks = re.findall(r'python -c "import ([^;"]+)', text)
    assert checks
    names = [name.strip() for check in checks for name in check.split(",")]
    assert any(name.startswith("bertforge.") for name in names)
    for name in names:
        assert name.split(".")[0] not in FOLDERS, name
        if name.startswith("bertforge."):
            assert importlib.util.find_spec(name) is not None, name


def test_flex_template_runs_the_installed_prepare_job(tmp_path):
    dockerfile = DOCKERFILES["dataflow"]
    [py_file] = re.findall(r"^ENV FLEX_TEMPLATE_PYTHON_PY_FILE=(\S+)$", dockerfile.read_text(),
                           re.M)
    [source] = [args[0] for args in _instructions(dockerfile, "COPY") if args[-1] == py_file]
    # The launcher runs `python FILE --param=value ...`; from elsewhere than the checkout.
    done = subprocess.run([sys.executable, str(ROOT / source), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--input" in done.stdout and "--output" in done.stdout


def test_readme_python_examples_import_what_they_name():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    imports = [node for block in blocks for node in ast.walk(ast.parse(block))
               if isinstance(node, ast.ImportFrom | ast.Import)]
    assert imports
    for node in imports:
        for module, names in ([(node.module, [a.name for a in node.names])]
                              if isinstance(node, ast.ImportFrom)
                              else [(a.name, []) for a in node.names]):
            assert module.split(".")[0] not in FOLDERS, f"README: {module} (bertforge.{module}?)"
            imported = importlib.import_module(module)
            assert all(hasattr(imported, name) for name in names), (module, names)


def test_training_image_is_cuda_non_root_without_entrypoint():
    text = (INFRA / "docker" / "train.Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:12\.\S+", text, re.M)
    assert "--no-build-isolation" in text and "deepspeed" in text
    assert re.search(r"^RUN pip install \.", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert not re.search(r"^ENTRYPOINT", text, re.M)
    assert not re.search(r"^(ARG|ENV)\s+\S*(TOKEN|SECRET|PASSWORD|KEY)\S*=", text, re.M | re.I)


SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "AWS secret key": re.compile(r"aws_secret_access_key\s*[:=]\s*\S+", re.I),
    "service-account key": re.compile(r'"private_key(_id)?"\s*:'),
    "literal password": re.compile(
        r"\bpassword\s*[:=]\s*(?!\s*$)(?!\s*[\"']?\$)(?!\s*<)\S+", re.I),
    "bearer token": re.compile(r"Bearer\s+[A-Za-z0-9._-]{16,}"),
    "GitHub / Slack token": re.compile(r"\b(ghp_[A-Za-z0-9]{30,}|xox[abp]-[A-Za-z0-9-]{10,})"),
}


def test_secret_patterns_catch_the_obvious():
    assert SECRET_PATTERNS["AWS access key id"].search("key: AKIAIOSFODNN7EXAMPLE")
    assert SECRET_PATTERNS["literal password"].search("  password: hunter2")
    assert not SECRET_PATTERNS["literal password"].search("--password-stdin registry")
    assert not SECRET_PATTERNS["literal password"].search("password: ${DB_PASSWORD}")


@pytest.mark.parametrize("path", INFRA_FILES + [README], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_credentials_in_deployment_files(path):
    text = path.read_text(encoding="utf-8")
    found = [name for name, pattern in SECRET_PATTERNS.items() if pattern.search(text)]
    assert not found, f"{path}: looks like a credential ({', '.join(found)})"


# --- local Ray on loopback --------------------------------------------------------------------



@pytest.mark.slow
def test_local_ray_listens_on_loopback_only(monkeypatch, tmp_path):
    import psutil
    import ray
    from ray._private import ray_constants

    from bertforge.cluster.launch.ray_train import LaunchConfig, connect

    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    # connect() switches these for the process; give them back afterwards.
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                       os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1"))
    for name in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)  # restored (to unset) afterwards
    me = psutil.Process()
    # What this test process already had open (an earlier module's in-process torch store on
    # this xdist worker, say) is not the local Ray's.
    before = set(listening_sockets([me]))
    connect(LaunchConfig(workers=1))
    try:
        processes = [me] + me.children(recursive=True)
        listening = listening_sockets(processes)
        assert len(processes) > 3 and listening  # gcs, raylet, dashboard... really started
        exposed = [entry for entry in listening
                   if entry[1] not in LOOPBACK and entry not in before]
        assert not exposed, f"listening beyond the loopback address: {exposed}"
        # Nor on 8265, where `bertforge submit` (and `ray job submit`) look for a cluster's
        # tunnelled dashboard: a job sent there must not run in this throw-away Ray.
        from bertforge.cluster.launch.submit import DEFAULT_ADDRESS

        submit_port = int(DEFAULT_ADDRESS.rsplit(":", 1)[1])
        taken = [entry for entry in listening if entry[2] == submit_port and entry not in before]
        assert not taken, f"the private Ray took submit's port: {taken}"
    finally:
        ray.shutdown()


def test_the_training_image_runs_the_ray_the_manifests_name():
    """Every node of a cluster runs one Ray: the image's pin is the KubeRay rayVersion."""
    (pinned,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILES["train"].read_text(), re.M)
    for name in ("raycluster.yaml", "rayjob.yaml"):
        versions = re.findall(r'rayVersion: "([^"]+)"', (INFRA / "kubernetes" / name).read_text())
        assert versions == [pinned], (name, versions, pinned)
