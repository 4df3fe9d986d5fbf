"""The control protocol: the typed messages the trainer, the replicas and the operator send each other.

- `DrafterPublished` (trainer -> replicas): a new version in the model store: its directory (`uri`), the sha256 of
  its SHA256SUMS, its parent and the gate's figures;
- `DrafterRejected` (a replica -> trainers and the other replicas): live traffic rolled the version back; the
  others roll back too, trainers gate against the previous version again;
- `DrafterPromoted` (a replica -> trainers): live traffic kept the version; trainers record both verdicts in the
  model store, where a restarting replica reads them;
- `RetrainRequested` (`dvi retrain` -> trainers): train now.

On the wire a message is one JSON object: its `type` (the class's `kind`), its fields and `time` (unix seconds),
and, when the channel is authenticated (`stream.control_auth`, the default), `signer` and `signature`: an Ed25519
signature by the key of the role that may say it (SIGNER: the trainer publishes and is asked to retrain; replicas
give verdicts; see dvi.keys). `Verifier` is the authenticated reader: it refuses a message that is unsigned, signed
by another role or key, older than MAX_AGE_S, or a replay of one it has seen.
`decode` is the one way in: bytes that are not a JSON object of a known type with fields of the right types and
sizes (version names plain names, texts and gates bounded, the whole at most `MAX_BYTES`) raise `ControlError`
saying what is wrong; fields it does not know are ignored, so a newer writer can add one. This module
knows JSON and the messages' shapes; Kafka is `streams.control`'s, what a message makes happen is the replica's
and the trainer's.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Union

from dvi.errors import DviError
from dvi.keys import Keys

MAX_BYTES = 64 << 10  # a control message is a few hundred bytes; anything near this is not one of ours
MAX_TEXT = 1000  # characters of a free-text field (a reason, a uri)
MAX_GATE = 32  # figures in a gate
VERSION = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a drafter version's name: a plain name, never a path


class ControlError(ValueError):
    """Bytes that are not a control message of this protocol."""


@dataclass(frozen=True)
class DrafterPublished:
    kind: ClassVar[str] = "drafter_published"
    version: str
    uri: str  # the version's directory in the model store
    sha256: str  # of its SHA256SUMS: pins every file of the version
    parent: str | None = None
    gate: dict[str, float] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class DrafterRejected:
    kind: ClassVar[str] = "drafter_rejected"
    version: str
    replica_id: str
    reason: str = ""
    previous: str | None = None  # the version the replica went back to
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class DrafterPromoted:
    kind: ClassVar[str] = "drafter_promoted"
    version: str
    replica_id: str
    acceptance: float | None = None  # live acceptance over the judged window
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RetrainRequested:
    kind: ClassVar[str] = "retrain"
    reason: str = ""
    time: float = field(default_factory=time.time)


Message = Union[DrafterPublished, DrafterRejected, DrafterPromoted, RetrainRequested]
KINDS: dict[str, type] = {cls.kind: cls for cls in (DrafterPublished, DrafterRejected, DrafterPromoted, RetrainRequested)}

# the type each field must have on the wire ("?": may be null)
_FIELD_TYPES = {"version": "version", "uri": "str", "sha256": "str", "replica_id": "str", "parent": "version?",
                "previous": "version?", "reason": "text", "acceptance": "number?", "gate": "numbers", "time": "number"}


def check_version(name: object) -> str:
    """`name` if it is a drafter version name (letters, digits, '.', '_', '-'; 1 to 64; not '.' or '..'), else
    ControlError."""
    if not isinstance(name, str) or not VERSION.fullmatch(name) or name in (".", ".."):
        raise ControlError(f"invalid drafter version name {str(name)[:80]!r}: use 1 to 64 letters, digits, '.', '_' and '-'")
    return name


# who may say what: the role whose key must sign each kind of message (see dvi.keys)
SIGNER = {DrafterPublished.kind: "trainer", RetrainRequested.kind: "trainer", DrafterRejected.kind: "replica",
          DrafterPromoted.kind: "replica"}
MAX_AGE_S = 600.0  # a signed message older than this (by its own time) is refused: a replay, or a clock far off


def encode(msg: Message, keys: Keys | None = None) -> bytes:
    """The message as JSON bytes; signed by the role SIGNER names when `keys` is given (DviError when this process
    holds no such key)."""
    obj = {"type": msg.kind, **dataclasses.asdict(msg)}
    if keys is not None:
        obj["signer"] = SIGNER[msg.kind]
        obj["signature"] = base64.b64encode(keys.sign(obj["signer"], _canonical(obj))).decode()
    return json.dumps(obj, sort_keys=True).encode()


def decode(data: bytes) -> Message:
    """The message in `data` (see the module docstring); ControlError naming what is wrong. Signatures are not
    looked at: `Verifier` is the reader that checks them."""
    return _message(_object(data))


class Verifier:
    """Decodes signed messages: ControlError unless the message is signed by the role SIGNER names, with a key of
    `keys.trusted`, its time is within MAX_AGE_S of now (and not ahead of it by as much), and its signature was
    not seen before (a replay). Remembers the signatures of the last MAX_AGE_S, at most `remember` of them; with a
    `seen_file`, across restarts too: each accepted signature is appended to it (one JSON line), and a verifier
    started on the same file refuses them as replays while they are within MAX_AGE_S. One file per reader that acts
    on messages (a replica, a trainer): another reader's is no record of what this one has acted on."""

    def __init__(self, keys: Keys, max_age_s: float = MAX_AGE_S, remember: int = 100_000, seen_file: Path | None = None):
        self.keys, self.max_age_s, self.remember = keys, max_age_s, remember
        self._seen: dict[bytes, float] = {}  # signature -> the message's time
        self.seen_file = Path(seen_file) if seen_file is not None else None
        if self.seen_file is not None:
            self._load_seen(time.time())

    def _load_seen(self, now: float) -> None:
        """The signatures still within MAX_AGE_S from `seen_file` (lines that do not parse are skipped), written back
        as the file's whole content (older ones dropped)."""
        try:
            lines = self.seen_file.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as e:
            raise DviError(f"cannot read the control messages seen so far from {self.seen_file}: {e}") from None
        self._seen = {}
        for line in lines[-self.remember:]:
            try:
                entry = json.loads(line)
                raw, t = base64.b64decode(entry["s"], validate=True), float(entry["t"])
            except (ValueError, KeyError, TypeError):
                continue
            if abs(now - t) <= self.max_age_s:
                self._seen[raw] = t
        try:
            self.seen_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.seen_file.with_name(self.seen_file.name + ".tmp")
            tmp.write_text("".join(self._line(raw, t) for raw, t in self._seen.items()), encoding="utf-8")
            os.replace(tmp, self.seen_file)
        except OSError as e:
            raise DviError(f"cannot write the control messages seen so far to {self.seen_file}: {e}") from None

    @staticmethod
    def _line(raw: bytes, t: float) -> str:
        return json.dumps({"s": base64.b64encode(raw).decode(), "t": t}) + "\n"

    def _remember(self, raw: bytes, t: float) -> None:
        self._seen[raw] = t
        if self.seen_file is None:
            return
        try:  # before the message is acted on: a crash after this line never lets it in again
            with open(self.seen_file, "a", encoding="utf-8") as f:
                f.write(self._line(raw, t))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # the message is refused: acting on what could be replayed after a restart is worse
            self._seen.pop(raw, None)
            raise ControlError(f"cannot record it in {self.seen_file} ({e}), so a restart could not tell a replay of it") from None

    def __call__(self, data: bytes, now: float | None = None) -> Message:
        obj = _object(data)
        signature, signer = obj.pop("signature", None), obj.get("signer")
        role = SIGNER.get(obj.get("type"))
        if not isinstance(signature, str) or signer != role:
            raise ControlError(f"not signed by a {role or 'known'} key (signer {str(signer)[:32]!r})")
        try:
            raw = base64.b64decode(signature, validate=True)
        except ValueError:
            raise ControlError("a signature that is not base64") from None
        if not self.keys.verify(role, raw, _canonical(obj)):
            raise ControlError(f"the signature does not verify with the trusted {role} key: forged, altered, or signed "
                               "by another deployment's key")
        msg = _message(obj)
        now = time.time() if now is None else now
        if abs(now - msg.time) > self.max_age_s:
            raise ControlError(f"sent {now - msg.time:.0f} s ago: older than {self.max_age_s:g} s (a replay, or a clock far off)")
        if raw in self._seen:
            raise ControlError("a replay of a message already received")
        self._remember(raw, msg.time)
        if len(self._seen) > self.remember:
            self._seen = {k: t for k, t in self._seen.items() if now - t <= self.max_age_s}
            while len(self._seen) > self.remember:
                self._seen.pop(next(iter(self._seen)))
        return msg


def _canonical(obj: dict) -> bytes:
    """The bytes a signature covers: the message without its signature, keys sorted, no spaces."""
    return json.dumps({k: v for k, v in obj.items() if k != "signature"}, sort_keys=True, separators=(",", ":")).encode()


def _object(data: bytes) -> dict:
    if len(data) > MAX_BYTES:
        raise ControlError(f"{len(data)} bytes, over the {MAX_BYTES}-byte bound of a control message")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ControlError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ControlError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _message(obj: dict) -> Message:
    cls = KINDS.get(obj.get("type")) if isinstance(obj.get("type"), str) else None
    if cls is None:
        raise ControlError(f"unknown message type {str(obj.get('type'))[:64]!r}")
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            fields[f.name] = _checked(f.name, obj[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ControlError(f"{cls.kind} without {f.name}")
    return cls(**fields)


def _checked(name: str, value: Any) -> Any:
    expected = _FIELD_TYPES[name]
    if expected.endswith("?") and value is None:
        return None
    kind = expected.rstrip("?")
    if kind == "version":
        return check_version(value)
    if kind in ("str", "text"):
        if not isinstance(value, str) or (kind == "str" and not value) or len(value) > MAX_TEXT:
            raise ControlError(f"{name}: expected a{' non-empty' if kind == 'str' else ''} string of at most {MAX_TEXT} characters")
        return value
    if kind == "number":
        if not _number(value):
            raise ControlError(f"{name}: expected a finite number")
        return float(value)
    if (not isinstance(value, dict) or len(value) > MAX_GATE
            or not all(isinstance(k, str) and len(k) <= 64 and _number(v) for k, v in value.items())):
        raise ControlError(f"{name}: expected an object of at most {MAX_GATE} finite numbers")
    return {k: float(v) for k, v in value.items()}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
