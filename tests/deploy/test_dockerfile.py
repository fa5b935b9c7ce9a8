"""Dockerfile: hadolint-clean, structurally what the deployment expects, and its entrypoint and
health check are commands the ``lutb`` CLI accepts. (No Docker engine here: nothing is built.)"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex

import pytest
import yaml

from deploy_support import (
    DEPLOY,
    REPO,
    dockerfile_instructions,
    env_assignments,
    exec_form,
    require_tool,
    run_tool,
)

DOCKERFILE = REPO / "Dockerfile"
UID = "10001"


@pytest.fixture(scope="module")
def instructions():
    return dockerfile_instructions(DOCKERFILE)


def _only(instructions, keyword: str):
    found = [i for i in instructions if i.keyword == keyword]
    return found


def _final_stage(instructions):
    starts = [n for n, i in enumerate(instructions) if i.keyword == "FROM"]
    return instructions[starts[-1]:]


def test_hadolint_clean() -> None:
    hadolint = require_tool("hadolint")
    proc = run_tool([hadolint, "--no-color", "--failure-threshold", "info", DOCKERFILE], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path) -> None:
    """The lint above can fail: a `latest` base image and an unpinned apt install are flagged."""
    hadolint = require_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nCMD lutb serve\n")
    proc = run_tool([hadolint, "--no-color", bad], timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3025"):
        assert rule in proc.stdout, proc.stdout


def test_every_lint_exception_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for n, line in enumerate(lines):
        if "hadolint ignore=" in line or "checkov:skip=" in line:
            reason = lines[n - 1].strip()
            assert reason.startswith("#") and len(reason) > 20, f"line {n + 1}: no reason above {line!r}"


def test_base_images_pinned_and_identical(instructions) -> None:
    bases = [i.args.split()[0] for i in _only(instructions, "FROM")]
    assert len(bases) == 2, "multi-stage: builder + runtime"
    assert bases[0] == bases[1], bases
    image = bases[0]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d\d\.\d\d(@sha256:[0-9a-f]{64})?", image), image
    cuda = re.search(r":(\d+)\.(\d+)", image).groups()
    index = re.search(r"TORCH_INDEX_URL=(\S+)", DOCKERFILE.read_text()).group(1)
    assert index.endswith(f"/cu{cuda[0]}{cuda[1]}"), f"torch index {index} does not match base CUDA {cuda}"
    assert _only(instructions, "FROM")[0].args.split()[-1] == "builder"


def test_builder_installs_project_with_cuda_extra(instructions) -> None:
    runs = " ".join(i.args for i in _only(instructions, "RUN"))
    assert 'pip install --no-cache-dir ".[cuda]"' in runs
    assert re.search(r'pip install --no-cache-dir "torch==\$\{TORCH_VERSION\}" --index-url', runs)
    final = _final_stage(instructions)
    copies = [i.args for i in final if i.keyword == "COPY"]
    assert copies == ["--from=builder /opt/lutb /opt/lutb"], "runtime stage takes only the venv"


def test_runs_as_fixed_non_root_user(instructions) -> None:
    final = _final_stage(instructions)
    users = [i.args for i in final if i.keyword == "USER"]
    assert users == [f"{UID}:{UID}"]
    runs = " ".join(i.args for i in final if i.keyword == "RUN")
    assert f"--uid {UID}" in runs and f"--gid {UID}" in runs
    # The manifests run the same UID.
    for path in DEPLOY.rglob("*.yaml"):
        for uid in re.findall(r"runAsUser: (\d+)", path.read_text()):
            assert uid == UID, path


def test_environment_and_ports(instructions) -> None:
    env = env_assignments(instructions)
    assert env["LUTB_HOST"] == "0.0.0.0"
    assert (env["LUTB_PORT"], env["LUTB_METRICS_PORT"]) == ("50051", "9400")
    assert env["LUTB_DEMO_DIR"].startswith("/tmp/")
    # Every path a library may write to is under /tmp (read-only root filesystem in Kubernetes).
    for key in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert env[key] == "/tmp" or env[key].startswith("/tmp/"), key
    exposed = {p for i in _only(instructions, "EXPOSE") for p in i.args.split()}
    assert exposed == {env["LUTB_PORT"], env["LUTB_METRICS_PORT"]}


def test_entrypoint_and_healthcheck_parse_with_the_cli(instructions) -> None:
    """The image runs `lutb serve` and checks `lutb health ...`: both must be accepted by the
    real parser (``lutb_server.cli.build_parser``), with the image's port."""
    from lutb_server.cli import build_parser

    final = _final_stage(instructions)
    entry = exec_form([i for i in final if i.keyword == "ENTRYPOINT"][-1].args)
    cmd = exec_form([i for i in final if i.keyword == "CMD"][-1].args)
    assert entry[0] == "lutb"
    serve = build_parser().parse_args(entry[1:] + cmd)
    assert entry[1:] + cmd == ["serve"] and callable(serve.run)

    health = [i for i in final if i.keyword == "HEALTHCHECK"]
    assert len(health) == 1
    options, _, command = health[0].args.partition("CMD ")
    assert re.search(r"--start-period=(\d+)s", options) and int(re.search(r"--start-period=(\d+)s", options).group(1)) >= 300
    shell, flag, script = exec_form(command)
    assert (shell, flag) == ("/bin/sh", "-c")
    check, _, fallback = script.partition("||")
    assert fallback.strip() == "exit 1", "Docker reserves exit code 2; map every failure to 1"
    port = env_assignments(instructions)["LUTB_PORT"]
    assert f"${{LUTB_PORT:-{port}}}" in check, "the check must follow a LUTB_PORT given at run time"
    argv = shlex.split(check.replace(f"${{LUTB_PORT:-{port}}}", port))  # as the shell expands it with the image's env
    assert argv[0] == "lutb"
    args = build_parser().parse_args(argv[1:])
    assert argv[1] == "health" and callable(args.run)
    assert args.target == f"127.0.0.1:{port}"
    timeout = float(re.search(r"--timeout=(\d+)s", options).group(1))
    assert args.timeout < timeout


# Every LUTB_* variable the manifests and the image may set, and the `lutb serve` flag it
# stands for (the CLI contract of issue 8).
SERVE_ENV = {
    "LUTB_CHECKPOINT": "--checkpoint",
    "LUTB_HOST": "--host",
    "LUTB_PORT": "--port",
    "LUTB_METRICS_PORT": "--metrics-port",
    "LUTB_BACKEND": "--backend",
    "LUTB_DEVICE": "--device",
    "LUTB_MAX_BATCH_TOKENS": "--max-batch-tokens",
    "LUTB_MAX_WAIT_US": "--max-wait-us",
    "LUTB_MAX_QUEUE_REQUESTS": "--max-queue-requests",
    "LUTB_MAX_TOKENS_PER_REQUEST": "--max-tokens-per-request",
    "LUTB_SHUTDOWN_GRACE_S": "--shutdown-grace-s",
    "LUTB_CONFIG": "--config",
    "LUTB_DEMO_DIR": "--demo-dir",
    "LUTB_COMPUTE_WORKER": "--compute-worker",
    "LUTB_FRONT_ENDS": "--front-ends",
}


def _configured_lutb_env(instructions) -> dict[str, str]:
    """LUTB_* settings from the image ENV and from every ConfigMap literal / env under deploy/."""
    found = {k: v for k, v in env_assignments(instructions).items() if k.startswith("LUTB_")}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        text = path.read_text()
        found.update(re.findall(r"^\s*- (LUTB_[A-Z0-9_]+)=(\S+)\s*$", text, re.M))
        for doc in yaml.safe_load_all(text):
            for c in ((doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
                found.update({e["name"]: e.get("value", "") for e in c.get("env", []) if e["name"].startswith("LUTB_")})
    return found


def test_configured_settings_are_serve_flags(instructions) -> None:
    """Each LUTB_* the image or manifests set is a known setting whose value the corresponding
    `lutb serve` flag accepts (types and choices included)."""
    from lutb_server.cli import build_parser

    settings = _configured_lutb_env(instructions)
    assert {"LUTB_HOST", "LUTB_PORT", "LUTB_METRICS_PORT", "LUTB_SHUTDOWN_GRACE_S", "LUTB_CHECKPOINT"} <= set(settings)
    unknown = set(settings) - set(SERVE_ENV)
    assert not unknown, f"not a lutb serve setting: {sorted(unknown)}"
    argv = ["serve"]
    for key, value in sorted(settings.items()):
        argv += [SERVE_ENV[key], value.replace("$(POD_INDEX)", "0")]
    args = build_parser().parse_args(argv)
    assert callable(args.run)


def test_configured_settings_load_from_the_environment(instructions, monkeypatch) -> None:
    """The same values, as the pod's environment: the server's settings model accepts them."""
    from lutb_server.settings import load_settings

    for key in list(os.environ):
        if key.startswith("LUTB_"):
            monkeypatch.delenv(key)
    settings = _configured_lutb_env(instructions)
    for key, value in settings.items():
        monkeypatch.setenv(key, value.replace("$(POD_INDEX)", "0"))
    loaded = load_settings()
    assert loaded.port == int(settings["LUTB_PORT"])
    assert loaded.metrics_port == int(settings["LUTB_METRICS_PORT"])
    assert loaded.shutdown_grace_s == float(settings["LUTB_SHUTDOWN_GRACE_S"])
    assert (loaded.compute_worker, loaded.front_ends) == (settings["LUTB_COMPUTE_WORKER"], int(settings["LUTB_FRONT_ENDS"]))
    assert str(loaded.demo_dir).startswith("/tmp/")


def test_dockerignore_lets_the_build_context_through(instructions) -> None:
    """Every COPY source exists and is not excluded by .dockerignore (last matching rule wins)."""
    rules = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]

    def matches(path: str, pattern: str) -> bool:
        # A rule matches a path when it matches the path or one of its parent folders;
        # a leading "**/" matches at any depth.
        parts = path.split("/")
        if pattern.startswith("**/"):
            pieces = ["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
            return any(fnmatch.fnmatch(p, pattern[3:]) for p in pieces)
        return any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))

    def excluded(path: str) -> bool:
        result = False
        for rule in rules:
            if matches(path, rule.lstrip("!").rstrip("/")):
                result = not rule.startswith("!")
        return result

    builder = [i for i in instructions if i.keyword == "COPY" and "--from=" not in i.args]
    sources = [s for i in builder for s in i.args.split()[:-1]]
    assert sources, "the builder copies the sources"
    for source in sources:
        assert (REPO / source).exists(), f"COPY source missing: {source}"
        assert not excluded(source), f".dockerignore excludes {source}"
    for never in (".git", ".venv", ".venv-deploy", "tests", "bench/results", "kernels/x/__pycache__", "server/a.pyc"):
        assert excluded(never), never
    assert not excluded("kernels/lutb_kernels/tiles.py")
