"""Static checks of the production-shaped deployment in docker/ (no Docker engine needed).

The compose file is read with PyYAML and interpolated with the values of .env.example, as `docker compose`
would with a copied .env. Every `dvi` command line in it (image entrypoint + compose command) goes through
the real CLI parser and config loader, so an override that `dvi` would reject fails here.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dvi.cli import COMMANDS, build_parser
from dvi.config import load_config, overrides_of
from dvi.errors import DviError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"

DVI_SERVICES = ("models", "serve", "trainer")
DOCKERFILES = ("Dockerfile.serve", "Dockerfile.train", "Dockerfile.mlflow", "Dockerfile.serve-vllm")
NO_HEALTH_ENDPOINT = {"trainer"}  # a consumer-group member with no HTTP port; restart policy only
MIN_MLFLOW = (3, 10)

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, ${VAR:+alt}, ${VAR+alt}, $VAR; $$ is a literal $
_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


# ----------------------------------------------------------------------------------------------
# reading the files


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of duplicate keys; Compose rejects the file. Reject it here too."""

    def construct_mapping(self, node, deep=False):
        keys = [k.value for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {dup}", node.start_mark)
        return super().construct_mapping(node, deep)


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: bad variable name {key!r}"
        assert key not in env, f"{path.name}: {key} set twice"
        env[key] = value
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4)
        assert arg is None or "${" not in arg, f"nested interpolation is not handled here: {m.group(0)}"
        value = env.get(name)
        empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if (value is None if op == "-" else empty) else value
        if op in ("?", ":?"):
            if value is None if op == "?" else empty:
                raise AssertionError(f"{name} is required by compose.yaml ({arg}) but unset or empty in .env.example")
            return value
        if op in ("+", ":+"):
            return "" if (value is None if op == "+" else empty) else arg
        assert value is not None, f"{name} is used without a default in compose.yaml but missing from .env.example"
        return value

    return _VAR.sub(sub, text)


def referenced(text: str) -> set[str]:
    return {m.group(2) or m.group(5) for m in _VAR.finditer(text) if not m.group(1)}


def walk(node, fn):
    """A copy of a parsed YAML tree with `fn` applied to every string (keys included)."""
    if isinstance(node, dict):
        return {walk(k, fn): walk(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [walk(v, fn) for v in node]
    return fn(node) if isinstance(node, str) else node


def strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


def read_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        op, _, rest = buf.strip().partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    return out


def arg_defaults(instructions) -> dict[str, str]:
    return {k: v for op, rest in instructions if op == "ARG" and "=" in rest for k, v in [rest.split("=", 1)]}


def exec_form(instructions, op: str) -> list[str] | None:
    found = [rest for o, rest in instructions if o == op]
    if not found:
        return None
    value = json.loads(found[-1])  # exec form only: a shell-form entrypoint would not see `docker run` args
    assert isinstance(value, list)
    return value


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"v?(\d+(?:\.\d+)*)", v).group(1).split("."))


ENV = read_env(ENV_EXAMPLE)
RAW = yaml.load(COMPOSE.read_text(), Loader=UniqueKeyLoader)


@functools.cache
def spec() -> dict:
    """compose.yaml as `docker compose config` would see it with .env copied from .env.example."""
    return walk(RAW, lambda s: interpolate(s, ENV))


def services() -> dict:
    return spec()["services"]


def dockerfile_of(service: str) -> Path:
    build = services()[service]["build"]
    return (COMPOSE.parent / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()


def argv_of(service: str) -> list[str]:
    """What the container runs: compose entrypoint/command, else the image's ENTRYPOINT/CMD."""
    svc = services()[service]
    instructions = read_dockerfile(dockerfile_of(service)) if "build" in svc else []
    entrypoint = svc.get("entrypoint", exec_form(instructions, "ENTRYPOINT")) or []
    command = svc["command"] if "command" in svc else (exec_form(instructions, "CMD") or [])
    assert isinstance(entrypoint, list) and isinstance(command, list), f"{service}: use exec-form lists"
    return [str(a) for a in entrypoint + command]


def dvi_config(service: str):
    """Parse the service's dvi command line exactly as `dvi.cli.main` does, then load its config."""
    argv = argv_of(service)
    assert argv[0] == "dvi", f"{service} runs {argv[0]!r}, not dvi"
    args, unknown = build_parser().parse_known_args(argv[1:])
    if unknown:
        args.overrides = list(getattr(args, "overrides", []) or []) + unknown
    assert getattr(args, "run", None), f"{service}: {argv[1:3]} is not a dvi command"
    overrides = overrides_of(args)
    return args, overrides, load_config(overrides)


def volume_mounts(service: str) -> dict[str, tuple[str, bool]]:
    """container path -> (volume name, read-only)"""
    out = {}
    for v in services()[service].get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


# ----------------------------------------------------------------------------------------------
# environment


def test_env_example_documents_exactly_the_compose_variables():
    used = set()
    for s in strings(RAW):
        used |= referenced(s)
    assert sorted(used - ENV.keys()) == [], "variables used in compose.yaml but not documented in .env.example"
    assert sorted(ENV.keys() - used) == [], "variables in .env.example that compose.yaml never uses"


def test_env_example_holds_placeholders_not_secrets():
    secrets = {k: v for k, v in ENV.items() if re.search(r"PASSWORD|SECRET|API_KEY|TOKEN", k)}
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "DVI_API_KEY"} <= secrets.keys()
    for key, value in secrets.items():
        assert value.startswith("change-me"), f"{key} in .env.example must be a change-me placeholder"
    assert len(ENV["MINIO_ROOT_PASSWORD"]) >= 8 and len(ENV["DVI_API_KEY"]) >= 8


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$SET $SET", env) == "x d  d $SET x"
    with pytest.raises(AssertionError):
        interpolate("${EMPTY:?needed}", env)
    with pytest.raises(AssertionError):
        interpolate("${UNSET}", env)


# ----------------------------------------------------------------------------------------------
# Kafka


def kafka_brokers() -> dict[str, dict]:
    return {name: svc for name, svc in services().items() if "KAFKA_NODE_ID" in (svc.get("environment") or {})}


def test_kafka_is_three_combined_kraft_nodes_with_a_full_quorum():
    brokers = kafka_brokers()
    assert len(brokers) == 3
    ids, cluster_ids, quorums = {}, set(), set()
    for name, svc in brokers.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", svc["image"]), svc["image"]
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
        ids[int(env["KAFKA_NODE_ID"])] = name
        cluster_ids.add(env["CLUSTER_ID"])
        controller_port = re.search(r"CONTROLLER://[^:,]*:(\d+)", env["KAFKA_LISTENERS"]).group(1)
        voters = {int(k): v for k, v in (x.split("@") for x in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))}
        assert {v.split(":")[1] for v in voters.values()} == {controller_port}
        quorums.add(tuple(sorted((k, v.split(":")[0]) for k, v in voters.items())))
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
        assert env["KAFKA_LOG_DIRS"] in volume_mounts(name), f"{name}: log dir not on a volume"
        assert has_healthcheck(name)
    # one quorum, the same on every node, listing every node (id -> its service) and nothing else
    assert quorums == {tuple(sorted(ids.items()))}
    assert len(cluster_ids) == 1 and len(cluster_ids.pop()) == 22
    assert len({volume_mounts(n)["/var/lib/kafka/data"][0] for n in brokers}) == 3, "each broker needs its own volume"


def test_topics_are_created_as_dvi_configures_them():
    from streams.topics import stream_topics

    _, _, cfg = dvi_config("serve")
    script = services()["kafka-topics"]["command"][0]
    created = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"--topic (\S+) --partitions (\d+) --replication-factor (\d+)", script)}
    assert {t: p for t, (p, _) in created.items()} == stream_topics(cfg.stream)
    assert {rf for _, rf in created.values()} == {3} == {cfg.stream.replication_factor}
    assert "--bootstrap-server kafka-1:9092,kafka-2:9092,kafka-3:9092" in script


# ----------------------------------------------------------------------------------------------
# MLflow


def test_mlflow_server_version_and_stores():
    svc = services()["mlflow"]
    version = svc["build"]["args"]["MLFLOW_VERSION"]
    assert version_tuple(version) >= MIN_MLFLOW
    assert svc["image"].endswith(f":{version}")
    dockerfile = read_dockerfile(dockerfile_of("mlflow"))
    assert version_tuple(arg_defaults(dockerfile)["MLFLOW_VERSION"]) >= MIN_MLFLOW
    assert any(op == "RUN" and '"mlflow==${MLFLOW_VERSION}"' in rest for op, rest in dockerfile)
    # the clients in the serve and trainer images install the tested version, constraints.txt's pin: the server's
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert pins["mlflow-skinny"] == pins["mlflow"] == version == arg_defaults(dockerfile)["MLFLOW_VERSION"]

    cmd = svc["command"]
    opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--") and not cmd[i + 1].startswith("--")}
    pg = services()["postgres"]["environment"]
    assert opt["--backend-store-uri"] == (
        f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    )
    assert opt["--artifacts-destination"].startswith(f"s3://{services()['minio-bucket']['environment']['BUCKET']}/")
    assert "--serve-artifacts" in cmd
    assert svc["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert svc["environment"]["AWS_SECRET_ACCESS_KEY"] == services()["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    assert "mlflow:5000" in svc["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert opt["--port"] == "5000" and opt["--host"] == "0.0.0.0"
    assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert svc["depends_on"]["minio-bucket"]["condition"] == "service_completed_successfully"


# ----------------------------------------------------------------------------------------------
# dvi command lines


@pytest.mark.parametrize("service", DVI_SERVICES)
def test_dvi_command_line_is_accepted_by_the_cli_and_config_loader(service):
    _, overrides, cfg = dvi_config(service)
    assert overrides, f"{service}: no config overrides"
    assert cfg.model.cache_dir == "/var/cache/dvi"
    assert volume_mounts(service)[cfg.model.cache_dir][0] == "model-cache"


def test_a_bad_override_fails_the_check():
    _, overrides, _ = dvi_config("serve")
    for bad in ("serve.spec.k=0", "serve.no_such_key=1", "stream.bootstrap_servers=kafka-1:9092,kafka-2:9092"):
        with pytest.raises(DviError):
            load_config(overrides + [bad])


def test_images_run_the_dvi_commands():
    commands = {c.words[0] for c in COMMANDS}
    for dockerfile, sub in (("Dockerfile.serve", "serve"), ("Dockerfile.train", "train")):
        entrypoint = exec_form(read_dockerfile(DOCKER / dockerfile), "ENTRYPOINT")
        assert entrypoint == ["dvi", sub]
        assert sub in commands
    out = subprocess.run([sys.executable, "-m", "dvi.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\bserve\b", out.stdout) and re.search(r"\btrain\b", out.stdout)
    assert argv_of("serve")[:2] == ["dvi", "serve"] and argv_of("trainer")[:2] == ["dvi", "train"]


def test_serve_and_trainer_share_stream_tracking_models_and_store():
    from dvi.store import serving_root

    _, _, serve = dvi_config("serve")
    _, _, train = dvi_config("trainer")
    _, _, models = dvi_config("models")
    assert serve.stream == train.stream
    assert serve.tracking == train.tracking
    assert serve.model == train.model
    for field in ("cache_dir", "target", "drafter_layers"):
        assert getattr(models.model, field) == getattr(serve.model, field)

    brokers = kafka_brokers()
    assert sorted(serve.stream.bootstrap_servers.split(",")) == sorted(f"{n}:9092" for n in brokers)
    assert serve.stream.replication_factor == 3
    assert serve.tracking.uri == "http://mlflow:5000"

    # drafters are announced by their path in the trainer's store: the same path must hold the same volume
    store = Path(train.trainer.store)
    assert serving_root(serve) == store
    assert volume_mounts("trainer")[str(store)] == ("model-store", False)
    assert volume_mounts("serve")[str(store)] == ("model-store", True)
    assert volume_mounts("trainer")[train.trainer.run_dir][0] == "trainer-runs"
    assert {"model-cache", "model-store", "trainer-runs"} <= set(spec()["volumes"])

    assert serve.serve.host == "0.0.0.0"
    assert services()["serve"]["ports"][0].endswith(f":{serve.serve.port}")
    health = " ".join(rest for op, rest in read_dockerfile(dockerfile_of("serve")) if op == "HEALTHCHECK")
    assert f"http://127.0.0.1:{serve.serve.port}/health" in health
    assert services()["serve"]["environment"]["DVI_API_KEY"] == ENV["DVI_API_KEY"]


def test_replicas_and_gpu_reservation():
    assert int(services()["serve"]["deploy"]["replicas"]) == int(ENV["DVI_SERVE_REPLICAS"]) >= 2
    assert "container_name" not in services()["serve"]  # replicas need generated names
    devices = services()["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and int(d["count"]) >= 1 for d in devices)


# ----------------------------------------------------------------------------------------------
# health, dependencies, images


def has_healthcheck(name: str) -> bool:
    """A healthcheck in compose.yaml, else the image's HEALTHCHECK; a disabled one does not count."""
    svc = services()[name]
    if "healthcheck" in svc:
        hc = svc["healthcheck"]
        return not hc.get("disable") and (hc.get("test") or ["NONE"])[0] != "NONE"
    if "build" in svc:
        checks = [rest for op, rest in read_dockerfile(dockerfile_of(name)) if op == "HEALTHCHECK"]
        return bool(checks) and checks[-1].split()[0] != "NONE"
    return False


def test_healthchecks_and_dependency_conditions():
    for name, svc in services().items():
        one_shot = svc.get("restart") == "no"
        if not one_shot and name not in NO_HEALTH_ENDPOINT:
            assert has_healthcheck(name), f"{name}: long-running service without a healthcheck"
        for dep, how in (svc.get("depends_on") or {}).items():
            assert dep in services(), f"{name} depends on unknown {dep}"
            cond = how["condition"]
            if cond == "service_healthy":
                assert has_healthcheck(dep), f"{name}: {dep} has no healthcheck"
            else:
                assert cond == "service_completed_successfully" and services()[dep].get("restart") == "no", (name, dep)
    for name in ("serve", "trainer"):
        deps = services()[name]["depends_on"]
        assert deps["mlflow"]["condition"] == "service_healthy"
        assert deps["kafka-topics"]["condition"] == "service_completed_successfully"
        assert deps["models"]["condition"] == "service_completed_successfully"
    assert {d: s["condition"] for d, s in services()["kafka-topics"]["depends_on"].items()} == {
        n: "service_healthy" for n in kafka_brokers()
    }


def test_pulled_images_are_pinned():
    for name, svc in services().items():
        if "build" in svc:
            continue
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and tag not in ("", "latest"), f"{name}: image {image} is not pinned"
    for dockerfile in DOCKERFILES:
        instructions = read_dockerfile(DOCKER / dockerfile)
        args = arg_defaults(instructions)
        for op, rest in instructions:
            if op == "FROM":
                image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
                assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), f"{dockerfile}: {image}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_basics(dockerfile):
    instructions = read_dockerfile(DOCKER / dockerfile)
    users = [rest for op, rest in instructions if op == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile}: runs as root"
    ignore = (DOCKER / f"{dockerfile}.dockerignore").read_text().splitlines()
    for op, rest in instructions:
        if op == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert f"!{src.rstrip('/')}" in ignore or f"!{src.rstrip('/')}/" in ignore, (
                    f"{dockerfile}: COPY {src} is excluded by {dockerfile}.dockerignore"
                )


@pytest.mark.parametrize("dockerfile", ["Dockerfile.serve", "Dockerfile.train", "Dockerfile.serve-vllm"])
def test_dvi_images_install_the_project_and_its_config(dockerfile):
    instructions = read_dockerfile(DOCKER / dockerfile)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    # every top-level source folder of the packages (conf/ ships as dvi/conf), the readme and the license files
    sources = {setuptools.get("package-dir", {}).get(p, p).split(".")[0] for p in setuptools["packages"]}
    needed = {"pyproject.toml", project["project"]["readme"], *project["project"]["license-files"]} | sources
    assert "conf" in needed
    copied = {Path(src).name for op, rest in instructions if op == "COPY" and not rest.startswith("--from")
              for src in rest.split()[:-1]}
    assert needed <= copied, f"{dockerfile} does not copy {sorted(needed - copied)}"
    assert project["project"]["scripts"]["dvi"] == "dvi.cli:main"
    # the wheel carries conf/: the image reads the installed copy, no DVI_CONF_DIR to keep in step
    env = " ".join(rest for op, rest in instructions if op == "ENV")
    assert "DVI_CONF_DIR" not in env
    pip = " ".join(rest for op, rest in instructions if op == "RUN" and "pip " in rest)
    if dockerfile == "Dockerfile.serve-vllm":  # vLLM's image: every package it holds stays (vLLM, its torch), dvi adds the rest
        assert "pip freeze" in pip and "--constraint /tmp/image.txt" in pip
        assert exec_form(instructions, "ENTRYPOINT") == ["dvi", "serve"] and "serve.engine=vllm" in exec_form(instructions, "CMD")
        image = next(rest for op, rest in instructions if op == "FROM")
        vllm_pin = re.search(r'"vllm==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
        assert image.startswith("vllm/vllm-openai:") and arg_defaults(instructions)["VLLM_TAG"] == f"v{vllm_pin}"
        return
    assert "--constraint /tmp/torch.txt" in pip  # keeps the base image's CUDA torch
    assert "--constraint /tmp/src/constraints.txt" in pip and "constraints.txt" in copied  # the tested versions
