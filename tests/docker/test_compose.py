"""Static checks of the production-shaped deployment in docker/ (no Docker engine needed).

The compose file is read with PyYAML and interpolated with the values of .env.example, as `docker compose`
would with a copied .env. Every `dvi` command line in it (image entrypoint + compose command) goes through
the real CLI parser and config loader, so an override that `dvi` would reject fails here. The security set-up
(SASL_SSL listeners, ACLs, the MLflow login, secrets kept off command lines) is checked the same way: Kafka's
settings as the image turns the environment into properties, the ACL and SCRAM commands of the one-shot kafka-topics
service, the auth config the mlflow service writes, read by MLflow's own loader.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
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


@functools.cache
def dvi_config(service: str):
    """Parse the service's dvi command line exactly as `dvi.cli.main` does, then load its config (once per service)."""
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


def env_secrets() -> dict[str, str]:
    return {k: v for k, v in ENV.items() if re.search(r"PASSWORD|SECRET|API_KEY|TOKEN", k)}


def test_env_example_holds_placeholders_not_secrets():
    secrets = env_secrets()
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "DVI_API_KEY", "KAFKA_ADMIN_PASSWORD", "KAFKA_KEYSTORE_PASSWORD",
            "DVI_KAFKA_TRAINER_PASSWORD", "DVI_KAFKA_REPLICA_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD",
            "DVI_MLFLOW_PASSWORD"} <= secrets.keys()
    for key, value in secrets.items():
        assert value.startswith("change-me"), f"{key} in .env.example must be a change-me placeholder"
        # written into JAAS, properties and ini files and URIs: nothing there needs quoting or escaping
        assert re.fullmatch(r"[A-Za-z0-9._~-]+", value), f"{key}: URL-safe characters only"
    assert len(set(secrets.values())) == len(secrets), "every secret has its own placeholder"
    assert len(ENV["MINIO_ROOT_PASSWORD"]) >= 8 and len(ENV["DVI_API_KEY"]) >= 8
    assert len(ENV["KAFKA_KEYSTORE_PASSWORD"]) >= 6  # keytool's minimum
    assert len(ENV["MLFLOW_AUTH_ADMIN_PASSWORD"]) >= 12 and len(ENV["DVI_MLFLOW_PASSWORD"]) >= 12  # MLflow's minimum
    assert ENV["DVI_MLFLOW_USERNAME"] != ENV["MLFLOW_AUTH_ADMIN_USERNAME"], "dvi's MLflow account is not the admin"


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


# environment variables the apache/kafka image does not turn into server properties (its KafkaDockerWrapper)
KAFKA_NON_PROPERTIES = {"KAFKA_VERSION", "KAFKA_HEAP_OPT", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
                        "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL", "KAFKA_LOG4J_LOGGERS",
                        "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME"}


def kafka_properties(name: str) -> dict[str, str]:
    """A broker's server properties as the image writes them from its environment: KAFKA_A_B -> a.b, ___ -> -, __ -> _."""
    props = {}
    for key, value in services()[name]["environment"].items():
        if key.startswith("KAFKA_") and key not in KAFKA_NON_PROPERTIES:
            prop = key.replace("KAFKA_", "").lower().replace("_", ".").replace("...", "-").replace("..", "_")
            props[prop] = str(value)
    return props


def endpoints(value: str) -> dict[str, tuple[str, int]]:
    """listeners / advertised.listeners: listener name -> (host, port)."""
    out = {}
    for item in value.split(","):
        m = re.fullmatch(r"([A-Z_]+)://([^:]*):(\d+)", item.strip())
        assert m, f"not a listener: {item!r}"
        out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


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
        listeners, advertised = endpoints(env["KAFKA_LISTENERS"]), endpoints(env["KAFKA_ADVERTISED_LISTENERS"])
        assert {listener: (name, port) for listener, (_, port) in listeners.items() if listener != "CONTROLLER"} == advertised
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
    admin = ",".join(f"{n}:{endpoints(kafka_properties(n)['listeners'])['BROKER'][1]}" for n in sorted(kafka_brokers()))
    assert f"--bootstrap-server {admin} --command-config /tmp/admin.properties" in script


# ----------------------------------------------------------------------------------------------
# MLflow


def test_mlflow_server_version_and_stores():
    svc = services()["mlflow"]
    version = svc["build"]["args"]["MLFLOW_VERSION"]
    assert version_tuple(version) >= MIN_MLFLOW
    assert svc["image"].endswith(f":{version}")
    dockerfile = read_dockerfile(dockerfile_of("mlflow"))
    assert version_tuple(arg_defaults(dockerfile)["MLFLOW_VERSION"]) >= MIN_MLFLOW
    assert any(op == "RUN" and '"mlflow[auth]==${MLFLOW_VERSION}"' in rest for op, rest in dockerfile)
    # the clients in the serve and trainer images install the tested version, constraints.txt's pin: the server's
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert pins["mlflow-skinny"] == pins["mlflow"] == version == arg_defaults(dockerfile)["MLFLOW_VERSION"]

    cmd = svc["command"]
    opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--") and not cmd[i + 1].startswith("--")}
    pg = services()["postgres"]["environment"]
    # the store URI holds the database password: in the environment, which `mlflow server` reads, not on its command line
    assert "--backend-store-uri" not in cmd
    assert svc["environment"]["MLFLOW_BACKEND_STORE_URI"] == (
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
    # one stream; each side logs in to Kafka as its own principal
    assert serve.stream.security["sasl_plain_username"] != train.stream.security["sasl_plain_username"]
    assert without_username(serve.stream) == without_username(train.stream)
    assert serve.tracking == train.tracking
    assert serve.model == train.model
    for field in ("cache_dir", "target", "drafter_layers"):
        assert getattr(models.model, field) == getattr(serve.model, field)

    assert sorted(serve.stream.bootstrap_servers.split(",")) == sorted(client_endpoints())
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


def without_username(stream):
    return dataclasses.replace(stream, security={k: v for k, v in stream.security.items() if k != "sasl_plain_username"})


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
        assert exec_form(instructions, "ENTRYPOINT") == ["dvi", "serve"] and "serve.engine=vllm-server" in exec_form(instructions, "CMD")
        image = next(rest for op, rest in instructions if op == "FROM")
        vllm_pin = re.search(r'"vllm==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
        assert image.startswith("vllm/vllm-openai:") and arg_defaults(instructions)["VLLM_TAG"] == f"v{vllm_pin}"
        return
    assert "--constraint /tmp/torch.txt" in pip  # keeps the base image's CUDA torch
    assert "--constraint /tmp/src/constraints.txt" in pip and "constraints.txt" in copied  # the tested versions



# ----------------------------------------------------------------------------------------------
# security: Kafka over SASL_SSL with ACLs, MLflow behind a login, secrets only in environments

ADMIN = "User:admin"  # the brokers' own principal (replication, quorum) and the admin tools'


def client_endpoints() -> list[str]:
    """host:port of the listener dvi's services use (CLIENT), advertised by every broker."""
    return [f"{h}:{p}" for n in kafka_brokers() for h, p in [endpoints(kafka_properties(n)["advertised.listeners"])["CLIENT"]]]


def kafka_clients() -> dict:
    """dvi services that talk to the Kafka cluster -> their loaded config."""
    configs = {service: dvi_config(service)[2] for service in DVI_SERVICES}
    return {service: cfg for service, cfg in configs.items() if cfg.stream.bootstrap_servers}


def principal(cfg) -> str:
    return f"User:{cfg.stream.security['sasl_plain_username']}"


def script_of(service: str) -> str:
    """A one-shot's shell script (`entrypoint: [/bin/sh, -c]`, the script as its command), interpolated."""
    assert RAW["services"][service]["entrypoint"] == ["/bin/sh", "-c"]
    return services()[service]["command"][0]


def calls(service: str, function: str) -> list[list[str]]:
    """The arguments of each call of a shell function in a one-shot's script."""
    return [shlex.split(line)[1:] for line in script_of(service).splitlines() if line.strip().startswith(f"{function} ")]


def env_var_of(service: str, key: str) -> str:
    """The .env variable a service's environment entry is made from: exactly one `${VAR...}` reference."""
    value = RAW["services"][service]["environment"][key]
    m = re.fullmatch(r"\$\{([A-Z_][A-Z0-9_]*)(?::?[-?][^}]*)?\}", value)
    assert m, f"{service}: {key} must be one ${{VAR}} reference, not {value!r}"
    return m.group(1)


def jaas_options(jaas: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', jaas))


def acl_grants() -> set[tuple[str, str, str, str, str]]:
    """(principal, operation, resource type, name, pattern type) of every `acl` call in kafka-topics."""
    grants = set()
    for args in calls("kafka-topics", "acl"):
        opts: dict[str, list[str]] = {}
        for flag, value in zip(args[::2], args[1::2]):
            opts.setdefault(flag, []).append(value)
        assert len(args) % 2 == 0 and set(opts) <= {"--allow-principal", "--operation", "--topic", "--group",
                                                    "--resource-pattern-type"}, f"unexpected acl call {args}"
        assert "--operation" in opts, f"{args}: no --operation (kafka-acls would grant All)"
        (who,), pattern = opts["--allow-principal"], opts.get("--resource-pattern-type", ["literal"])[0]
        for kind in ("topic", "group"):
            for name in opts.get(f"--{kind}", []):
                grants |= {(who, op, kind, name, pattern) for op in opts["--operation"]}
    return grants


def test_every_kafka_listener_is_sasl_ssl():
    for name in kafka_brokers():
        props = kafka_properties(name)
        protocols = dict(item.split(":") for item in props["listener.security.protocol.map"].split(","))
        listeners, advertised = endpoints(props["listeners"]), endpoints(props["advertised.listeners"])
        assert set(protocols) == set(listeners) and set(advertised) <= set(listeners)
        # no PLAINTEXT listener (nor SASL without TLS, nor TLS without a login), advertised or internal
        assert set(protocols.values()) == {"SASL_SSL"}, f"{name}: {protocols}"
        assert props["inter.broker.listener.name"] == "BROKER" and props["controller.listener.names"] == "CONTROLLER"
        assert props["listener.name.client.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
        assert props["listener.name.broker.sasl.enabled.mechanisms"] == props["sasl.mechanism.inter.broker.protocol"] == "PLAIN"
        assert props["listener.name.controller.sasl.enabled.mechanisms"] == props["sasl.mechanism.controller.protocol"] == "PLAIN"
        for listener in listeners:  # every mechanism a listener takes has its JAAS settings
            for mechanism in props[f"listener.name.{listener.lower()}.sasl.enabled.mechanisms"].split(","):
                assert f"listener.name.{listener.lower()}.{mechanism.lower()}.sasl.jaas.config" in props, (name, listener)
        # TLS from the kafka-secrets volume; the peers' certificates checked against the CA (PEM: no password)
        assert props["ssl.keystore.type"] == "PKCS12" and props["ssl.keystore.location"].startswith("/etc/kafka/secrets/")
        assert props["ssl.truststore.type"] == "PEM" and props["ssl.truststore.location"] == "/etc/kafka/secrets/ca.pem"
        assert props.get("ssl.endpoint.identification.algorithm", "https") == "https"
        assert volume_mounts(name)["/etc/kafka/secrets"] == ("kafka-secrets", True)
        # the healthcheck logs in on the admin listener
        assert f':{listeners["BROKER"][1]}"' in " ".join(services()[name]["healthcheck"]["test"])


def test_dvi_services_connect_to_the_client_listener_over_sasl_ssl(monkeypatch):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    from streams.client import SASL_PASSWORD_ENV, client_options

    clients = kafka_clients()
    assert set(clients) == {"serve", "trainer"}
    mechanisms = {kafka_properties(n)["listener.name.client.sasl.enabled.mechanisms"] for n in kafka_brokers()}
    for service, cfg in clients.items():
        # only the CLIENT listener is given to dvi (not the admin one)
        assert sorted(cfg.stream.bootstrap_servers.split(",")) == sorted(client_endpoints())
        sec = cfg.stream.security
        assert sec["security_protocol"] == "SASL_SSL" and {sec["sasl_mechanism"]} == mechanisms
        assert sec.get("ssl_check_hostname", True) is True
        assert not any(re.search("password|secret|token", k) for k in sec), f"{service}: a secret in stream.security"
        # the CA certificate, from the kafka-trust volume, read-only
        assert volume_mounts(service)[str(Path(sec["ssl_cafile"]).parent)] == ("kafka-trust", True)
        # the password reaches every kafka-python client through the variable dvi reads, which compose sets
        password = services()[service]["environment"][SASL_PASSWORD_ENV]
        monkeypatch.setenv(SASL_PASSWORD_ENV, password)
        for cls in (KafkaProducer, KafkaConsumer, KafkaAdminClient):
            opts = client_options(cfg.stream, cls)
            assert (opts["security_protocol"], opts["sasl_mechanism"]) == ("SASL_SSL", "SCRAM-SHA-512")
            assert opts["sasl_plain_username"] == sec["sasl_plain_username"] and opts["sasl_plain_password"] == password
            assert opts["ssl_cafile"] == sec["ssl_cafile"]


def test_tls_material_is_made_once_and_split_by_who_needs_it():
    script = script_of("kafka-tls")
    assert services()["kafka-tls"]["restart"] == "no"
    brokers = kafka_brokers()
    for name in brokers:
        assert services()[name]["depends_on"]["kafka-tls"]["condition"] == "service_completed_successfully"
    # the broker certificate names every broker as clients and peers reach it
    sans = {d.removeprefix("dns:") for d in re.search(r"-ext SAN=(\S+)", script).group(1).split(",")}
    assert sans == {svc["hostname"] for svc in brokers.values()} == {
        h for n in brokers for h, _ in endpoints(kafka_properties(n)["advertised.listeners"]).values()}
    # written where the brokers read it
    props = kafka_properties(next(iter(brokers)))
    assert f"ks={props['ssl.keystore.location']}" in script and f"cp /tmp/ca.pem {props['ssl.truststore.location']}" in script
    # made only if missing: every key generation sits inside an `if` (CA absent; broker keystore absent or unreadable)
    depth = 0
    for line in script.splitlines():
        words = line.split()
        depth += words[:1] == ["if"]
        depth -= words[:1] == ["fi"]
        assert "-genkeypair" not in line or depth > 0, f"key made unconditionally: {line.strip()}"
    assert 'if [ ! -s "$ca" ]; then' in script and 'if ! kt -list -keystore "$ks" -alias broker' in script
    # the keystore password from the environment (keytool's :env), the same variable the brokers open it with
    assert "-storepass:env STOREPASS" in script and not re.search(r"-storepass\s", script)
    assert env_var_of("kafka-tls", "STOREPASS") == env_var_of("kafka-1", "KAFKA_SSL_KEYSTORE_PASSWORD")
    # the CA key stays with kafka-tls; the broker key with the brokers; every other service gets ca.pem alone
    users = {}
    for name, svc in services().items():
        for v in svc.get("volumes", []):
            users.setdefault(v.split(":")[0], set()).add(name)
    assert users["kafka-ca"] == {"kafka-tls"}
    assert users["kafka-secrets"] == {"kafka-tls", *brokers}
    assert users["kafka-trust"] >= {"kafka-tls", "kafka-topics", *kafka_clients()}
    for name in users["kafka-trust"] - {"kafka-tls"}:
        assert [ro for _, (vol, ro) in volume_mounts(name).items() if vol == "kafka-trust"] == [True], name


def test_the_authorizer_denies_what_no_acl_allows():
    clients = {principal(cfg) for cfg in kafka_clients().values()}
    for name in kafka_brokers():
        props = kafka_properties(name)
        assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
        assert props["allow.everyone.if.no.acl.found"] == "false"
        assert set(props["super.users"].split(";")) == {ADMIN}
        assert not clients & {ADMIN, "User:*", "User:ANONYMOUS"}
        # the super user is the principal the brokers log in to each other and to the quorum as, and nobody else
        for listener in ("broker", "controller"):
            opts = jaas_options(props[f"listener.name.{listener}.plain.sasl.jaas.config"])
            assert f"User:{opts['username']}" == ADMIN and set(opts) == {"username", "password", "user_admin"}
            assert opts["password"] == opts["user_admin"]


def test_acls_give_each_principal_only_what_dvi_needs():
    from streams.topics import stream_topics

    clients = kafka_clients()
    train, serve = clients["trainer"], clients["serve"]
    s, trainer, replica = train.stream, principal(train), principal(serve)
    assert trainer != replica
    # `dvi drafter distill` reads the topic in a consumer group of its own, named with this prefix
    assert 'group_id=f"dvi-distill-' in (ROOT / "dvi" / "cli" / "train.py").read_text()
    assert acl_grants() == {
        (trainer, "Read", "topic", s.topic, "literal"),
        (trainer, "Write", "topic", s.dlq_topic, "literal"),
        (trainer, "Read", "topic", s.control_topic, "literal"),
        (trainer, "Write", "topic", s.control_topic, "literal"),
        (trainer, "Read", "group", train.trainer.group_id, "literal"),
        (trainer, "Read", "group", "dvi-distill-", "prefixed"),
        (replica, "Write", "topic", s.topic, "literal"),
        (replica, "Read", "topic", s.control_topic, "literal"),
        (replica, "Write", "topic", s.control_topic, "literal"),
        (replica, "Describe", "topic", s.dlq_topic, "literal"),
    }
    # both sides check at start that every topic of the stream exists (streams.topics.ensure_topics): any grant on a
    # topic lets a principal see it, so neither ever tries to create one (only the admin may)
    for who in (trainer, replica):
        assert {name for p, _, kind, name, _ in acl_grants() if p == who and kind == "topic"} == set(stream_topics(s))


def test_only_dvi_roles_write_the_control_topic_and_only_the_trainer_key_publishes():
    from dvi.control import SIGNER, DrafterPublished, RetrainRequested

    clients = kafka_clients()
    control = clients["trainer"].stream.control_topic
    writers = {p for p, op, kind, name, pattern in acl_grants()
               if kind == "topic" and op in ("Write", "All") and (name == control or (pattern == "prefixed" and control.startswith(name)))}
    # replicas publish their verdicts (drafter_promoted / drafter_rejected) there, so they need Write on it too; what
    # each may say is decided by the Ed25519 key that signs it (dvi.keys), and only the trainer's key signs a drafter
    assert writers == {principal(clients["trainer"]), principal(clients["serve"])}
    assert SIGNER[DrafterPublished.kind] == SIGNER[RetrainRequested.kind] == "trainer"
    assert set(SIGNER.values()) == {"trainer", "replica"}
    assert all(cfg.stream.control_auth for cfg in clients.values())
    # the key that signs drafters is on the trainer's volume only; the replicas mount theirs
    keys_cmd = services()["keys"]["command"]
    trainer_dir, replica_dir = keys_cmd[keys_cmd.index("--trainer") + 1], keys_cmd[keys_cmd.index("--replica") + 1]
    assert volume_mounts("trainer")[clients["trainer"].stream.keys_dir][0] == volume_mounts("keys")[trainer_dir][0]
    assert volume_mounts("serve")[clients["serve"].stream.keys_dir][0] == volume_mounts("keys")[replica_dir][0]
    assert volume_mounts("keys")[trainer_dir][0] not in {vol for vol, _ in volume_mounts("serve").values()}


def test_each_principal_logs_in_with_its_own_password_from_env():
    from streams.client import SASL_PASSWORD_ENV

    # kafka-topics sets one SCRAM login per dvi principal, with the mechanism the CLIENT listener takes
    script = script_of("kafka-topics")
    assert "printf 'SCRAM-SHA-512=password=%s\\n'" in script and "--add-config-file /tmp/scram.properties" in script
    scram = {user: env_var_of("kafka-topics", arg.lstrip("$")) for user, arg in calls("kafka-topics", "scram")}
    clients = kafka_clients()
    assert set(scram) == {cfg.stream.security["sasl_plain_username"] for cfg in clients.values()}
    for service, cfg in clients.items():
        assert env_var_of(service, SASL_PASSWORD_ENV) == scram[cfg.stream.security["sasl_plain_username"]]
    admin = env_var_of("kafka-topics", "ADMIN_PASSWORD")
    assert len({admin, *scram.values()}) == len(scram) + 1, "one password per principal"
    # the brokers' admin password is the one the admin tools log in with
    assert 'password="$ADMIN_PASSWORD"' in script
    for name in kafka_brokers():
        for listener in ("BROKER", "CONTROLLER"):
            assert referenced(RAW["services"][name]["environment"][f"KAFKA_LISTENER_NAME_{listener}_PLAIN_SASL_JAAS_CONFIG"]) == {admin}


def test_no_secret_in_compose_or_on_a_command_line():
    text = COMPOSE.read_text()
    secrets = env_secrets()
    for key, value in secrets.items():
        assert value not in text, f"the value of {key} is written in compose.yaml"
    # every password-like setting in the file is a reference: ${VAR} (compose) or $VAR (a container's own environment)
    ref = r"\$\{[A-Z_][A-Z0-9_]*(?::?[-?][^}]*)?\}|\$\$[A-Z_][A-Z0-9_]*"
    for m in re.finditer(r'\b(password|user_\w+)="([^"]*)"', text):
        assert re.fullmatch(ref, m.group(2)), f"literal {m.group(1)} in compose.yaml: {m.group(0)}"
    for m in re.finditer(r"://[^/\s:@]+:([^/\s@]+)@", text):
        assert re.fullmatch(ref, m.group(1)), f"literal password in a URI: {m.group(0)}"
    for name, svc in RAW["services"].items():
        for key in svc.get("environment") or {}:
            if re.search(r"PASSWORD|SECRET|TOKEN|API_KEY|STOREPASS", key):
                env_var_of(name, key)
    # no secret reaches a command line: not a dvi one, nor any service's entrypoint, command or healthcheck
    for name, svc in services().items():
        argv = argv_of(name) if name in DVI_SERVICES else [*(svc.get("entrypoint") or []), *(svc.get("command") or [])]
        argv += list((svc.get("healthcheck") or {}).get("test") or [])
        for key, value in secrets.items():
            assert not any(value in str(a) for a in argv), f"{name}: {key} on its command line"
    for service in DVI_SERVICES:
        _, overrides, _ = dvi_config(service)
        assert not [o for o in overrides if re.search("password|secret|token|api_key", o.split("=", 1)[0])], service


def test_mlflow_runs_the_basic_auth_app(tmp_path, monkeypatch):
    import importlib.util

    svc, raw = services()["mlflow"], RAW["services"]["mlflow"]
    cmd = svc["command"]
    assert cmd[cmd.index("--app-name") + 1] == "basic-auth"
    dockerfile = read_dockerfile(dockerfile_of("mlflow"))
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    pip = " ".join(rest for op, rest in dockerfile if op == "RUN")
    assert '"mlflow[auth]==${MLFLOW_VERSION}"' in pip and f'"Flask-WTF=={pins["Flask-WTF"]}"' in pip
    # the entrypoint writes the auth config from the environment, then runs `mlflow server` with the command's options
    entrypoint = svc["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[2].rstrip().endswith('exec mlflow server "$@"')
    ini = re.search(r'cat > "\$MLFLOW_AUTH_CONFIG_PATH" <<EOF\n(.*?)\nEOF\n', entrypoint[2], re.S).group(1)
    env = svc["environment"]
    path = tmp_path / "basic_auth.ini"
    path.write_text(ini.replace("$MLFLOW_BACKEND_STORE_URI", env["MLFLOW_BACKEND_STORE_URI"]))
    for key in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(path))
    # read by MLflow's own loader (its module alone: importing the auth package would build MLflow's server app)
    config_py = Path(importlib.util.find_spec("mlflow").origin).parent / "server" / "auth" / "config.py"
    loader = importlib.util.spec_from_file_location("_mlflow_auth_config", config_py)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    auth = module.read_auth_config()
    assert auth.default_permission in ("READ", "NO_PERMISSIONS"), "logged-in users may not edit what others made"
    assert auth.database_uri == env["MLFLOW_BACKEND_STORE_URI"]
    assert auth.authorization_function == "mlflow.server.auth:authenticate_request_basic_auth"
    assert (auth.admin_username, auth.admin_password) == (ENV["MLFLOW_AUTH_ADMIN_USERNAME"], ENV["MLFLOW_AUTH_ADMIN_PASSWORD"])
    assert env["MLFLOW_AUTH_CONFIG_PATH"].startswith("/home/mlflow/")  # the image user's home: writable
    assert "MLFLOW_FLASK_SERVER_SECRET_KEY" in entrypoint[2]  # the auth app refuses to start without one
    assert raw["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"].startswith("${MLFLOW_AUTH_ADMIN_PASSWORD:?")
    # /health is the one path the auth app leaves open: the healthcheck needs no login
    assert svc["healthcheck"]["test"][-1].endswith("urlopen('http://127.0.0.1:5000/health', timeout=4)")


def test_dvi_services_log_in_to_mlflow_as_their_own_account():
    from dvi.mlflow_login import PASSWORD_VAR, USER_VAR

    # mlflow-users keeps dvi's account (made if missing, password set from .env), logged in as the admin
    users = services()["mlflow-users"]
    assert users["restart"] == "no" and users["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert env_var_of("mlflow-users", USER_VAR) == env_var_of("mlflow", "MLFLOW_AUTH_ADMIN_USERNAME")
    assert env_var_of("mlflow-users", PASSWORD_VAR) == env_var_of("mlflow", "MLFLOW_AUTH_ADMIN_PASSWORD")
    script = users["command"][0]
    assert "AuthServiceClient" in script and "create_user" in script and "update_user_password" in script
    account = (env_var_of("mlflow-users", "DVI_MLFLOW_USERNAME"), env_var_of("mlflow-users", "DVI_MLFLOW_PASSWORD"))
    # every dvi service that talks to the compose MLflow logs in with it, after mlflow-users has run
    tracked = [s for s in DVI_SERVICES if dvi_config(s)[2].tracking.uri == "http://mlflow:5000"]
    assert sorted(tracked) == ["serve", "trainer"]
    for service in tracked:
        assert (env_var_of(service, USER_VAR), env_var_of(service, PASSWORD_VAR)) == account, service
        assert services()[service]["depends_on"]["mlflow-users"]["condition"] == "service_completed_successfully"
    assert account[1] != env_var_of("mlflow", "MLFLOW_AUTH_ADMIN_PASSWORD")
