"""The control channel's signing keys: an Ed25519 key pair per role, `trainer` and `replica`, in one folder.

A trainer signs what only a trainer may say (a drafter was published; train now) with `trainer.key`; replicas
sign their verdicts (a drafter was kept or rolled back) with `replica.key`. Everyone verifies with the public
halves, `trainer.pub` and `replica.pub`, so a replica host holds no key that can publish a drafter:

    trainer host:  trainer.key  trainer.pub  replica.pub
    replica host:  replica.key  replica.pub  trainer.pub

`dvi keys init --trainer DIR --replica DIR` lays these out for a deployment on several hosts (docker/compose.yaml
runs it once). On one host (`dvi up`, the tests) the folder is `stream.keys_dir` (default <cache>/keys) and the
first process that needs a key makes it: the folder is 0700, private keys 0600, written under a temporary name and linked into
place, so two processes starting together end up with the same key. A private key that is missing on a host
whose folder already holds its public half is an error, not a new key: that host was given the public half on
purpose. This module knows files and Ed25519; which message needs which role is `dvi.control`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from dvi.errors import DviError
from dvi.files import write_once

ROLES = ("trainer", "replica")


@dataclass(frozen=True)
class Keys:
    """The private keys a process signs with and the public keys it trusts, by role."""

    signing: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    trusted: dict[str, Ed25519PublicKey] = field(default_factory=dict)

    def sign(self, role: str, data: bytes) -> bytes:
        if role not in self.signing:
            raise DviError(f"this process holds no {role} key, so it cannot send what only a {role} may say")
        return self.signing[role].sign(data)

    def verify(self, role: str, signature: bytes, data: bytes) -> bool:
        key = self.trusted.get(role)
        if key is None:
            return False
        try:
            key.verify(signature, data)
            return True
        except InvalidSignature:
            return False


def load(folder: Path, sign_as: tuple[str, ...] = (), create: bool = True) -> Keys:
    """The keys in `folder`: private keys of the roles in `sign_as` (made when missing and `create`, unless the
    folder holds that role's public half alone) and every public key there (the trainer's and the replicas' are
    both made with their private halves on one host)."""
    folder = Path(folder).expanduser()
    signing = {role: _private(folder, role, create) for role in sign_as}
    trusted = {}
    for role in ROLES:
        if role in signing:
            trusted[role] = signing[role].public_key()
        elif (folder / f"{role}.pub").is_file():
            trusted[role] = _public(folder / f"{role}.pub")
        elif create and not (folder / f"{role}.pub").exists():
            trusted[role] = _private(folder, role, create=True).public_key()  # one host: every role's pair is here
    return Keys(signing, trusted)


def init_hosts(trainer_dir: Path, replica_dir: Path) -> None:
    """Make (or keep) a trainer and a replica key pair and lay out each kind of host's folder: the trainer's
    holds trainer.key and both public keys, the replicas' holds replica.key and both public keys. Idempotent."""
    trainer_dir, replica_dir = Path(trainer_dir).expanduser(), Path(replica_dir).expanduser()
    trainer = _private(trainer_dir, "trainer", create=True)
    replica = _private(replica_dir, "replica", create=True)
    for folder, role, key in ((replica_dir, "trainer", trainer), (trainer_dir, "replica", replica)):
        _write_public(folder / f"{role}.pub", key)


def _private(folder: Path, role: str, create: bool) -> Ed25519PrivateKey:
    path, pub = folder / f"{role}.key", folder / f"{role}.pub"
    if not path.exists():
        if not create or pub.exists():
            raise DviError(f"no {role} signing key {path}: this host holds only the public half ({pub}); give it the "
                           f"{role} key, or run this command where it is")
        _make(folder, role)
    try:
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(path.read_text().strip()))
    except (OSError, ValueError) as e:
        raise DviError(f"{path} is not a readable {role} signing key ({e})") from None
    if not pub.exists():
        _write_public(pub, key)
    return key


def _write_public(path: Path, key: Ed25519PrivateKey) -> None:
    write_once(path, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex().encode(), mode=0o644)


def _public(path: Path) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(path.read_text().strip()))
    except (OSError, ValueError) as e:
        raise DviError(f"{path} is not a readable public key ({e})") from None


def _make(folder: Path, role: str) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    write_once(folder / f"{role}.key", raw.hex().encode(), mode=0o600)
