"""The target's features of a request's tokens: what an EAGLE-3 drafter reads, as serving captures them and records
carry them, so that a trainer needs no copy of the target.

An EAGLE-3 drafter reads, for each token, the target's aux hidden states at the layers it names (`dvi.eagle3`'s
`target_features`: the residual stream entering each of those layers, concatenated in ascending layer order, W =
layers x target hidden values a token). Serving computed exactly these when it verified the token: dvi's engine and
vLLM's (method eagle3) both run the target with those layers' outputs kept. This module owns three things:

- `Captured`: one request's features as its forwards give them, rows by sequence position (prompt, then output; a
  position is the token's index in prompt + output). A forward that runs again over positions it already gave (vLLM
  recomputing a preempted request) replaces their rows. A position no forward gave is a hole: vLLM serves a prompt
  prefix from its prefix cache without running the target over it (`serve.vllm.prefix_caching`, off by default).
  `assemble` keeps the longest run of positions without a hole that ends at the last one fed; the last token of a
  request is never fed to the target (it was sampled last), so a request of S tokens has at most S - 1 rows.
- `Features`: rows [R, W] for the positions start..start + R - 1 of a record's sequence, in an encoding: `bf16` (the
  target's own values, 2 bytes each) or `int8` (each layer's part of a row scaled by its absolute maximum to
  -127..127, a float32 scale per layer and row: 1 byte each, and the rounding error the benchmark reports). The
  decoded form is bf16 (`tensor`).
- `carries`: which requests carry features (`stream.features.share`): a deterministic function of the request id, so
  every chunk of a request agrees.

It knows torch and numpy; not records' wire format (`dvi.records` carries `Features`), engines or Kafka.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

ENCODINGS = ("bf16", "int8")
_INT8_MAX = 127.0


@dataclass(eq=False)
class Features:
    """Rows of the target's aux hidden states for consecutive positions of a sequence (see the module docstring)."""

    layers: tuple[int, ...]  # the target layers, ascending; W is a multiple of len(layers)
    start: int  # sequence position of the first row
    encoding: str  # "bf16" or "int8"
    data: np.ndarray  # [R, W] uint16 (bf16 bit patterns) or int8
    scales: np.ndarray | None = None  # [R, len(layers)] float32: int8 only, each layer's part of a row is data * scale

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Features):
            return NotImplemented
        scales = (self.scales is None and other.scales is None) or (
            self.scales is not None and other.scales is not None and np.array_equal(self.scales, other.scales))
        return ((self.layers, self.start, self.encoding) == (other.layers, other.start, other.encoding)
                and np.array_equal(self.data, other.data) and scales)

    __hash__ = None  # mutable arrays inside

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def width(self) -> int:
        return int(self.data.shape[1])

    @property
    def end(self) -> int:
        """The position after the last row."""
        return self.start + self.rows

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def row_bytes(self) -> int:
        """Bytes a row takes (its values and, int8, its scales)."""
        return self.nbytes // max(self.rows, 1) if self.rows else self.width * (2 if self.encoding == "bf16" else 1)

    @classmethod
    def encode(cls, rows: torch.Tensor, layers, start: int, encoding: str = "bf16") -> Features:
        """`rows` [R, W] (any float dtype, any device) in `encoding`."""
        if encoding not in ENCODINGS:
            raise ValueError(f"features encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        layers = tuple(int(i) for i in layers)
        x = rows.detach().to("cpu")
        if encoding == "bf16":
            return cls(layers, int(start), encoding, x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16))
        r, w = x.shape
        parts = x.float().reshape(r, len(layers), w // len(layers))  # [R, L, H]
        scale = parts.abs().amax(-1) / _INT8_MAX  # [R, L]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(parts / safe[..., None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).reshape(r, w)
        return cls(layers, int(start), encoding, q.numpy(), scale.numpy().astype(np.float32))

    def tensor(self) -> torch.Tensor:
        """The rows [R, W] as bfloat16."""
        data = self.data if self.data.flags.writeable else self.data.copy()  # torch takes writable arrays only
        if self.encoding == "bf16":
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16)
        r, w = data.shape
        scales = self.scales if self.scales.flags.writeable else self.scales.copy()
        parts = torch.from_numpy(np.ascontiguousarray(data)).float().reshape(r, len(self.layers), -1)
        return (parts * torch.from_numpy(scales)[..., None]).reshape(r, w).to(torch.bfloat16)

    def window(self, lo: int, hi: int) -> Features | None:
        """The rows of positions lo..hi - 1 that it has (None if none)."""
        lo, hi = max(lo, self.start), min(hi, self.end)
        if hi <= lo:
            return None
        a, b = lo - self.start, hi - self.start
        return Features(self.layers, lo, self.encoding, self.data[a:b], None if self.scales is None else self.scales[a:b])

    def last(self, rows: int) -> Features | None:
        """Its last `rows` rows (None for none)."""
        return self.window(self.end - rows, self.end) if rows > 0 else None

    def finite(self) -> bool:
        """No NaN or infinity among the values and scales."""
        if self.encoding == "bf16":
            return not bool(((self.data & 0x7F80) == 0x7F80).any())  # bf16's exponent all ones: inf or NaN
        return bool(np.isfinite(self.scales).all())


class Captured:
    """One request's features as its forwards give them (see the module docstring)."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, torch.Tensor]] = []  # (first position, rows [n, W]) in the order given
        self.layers: tuple[int, ...] = ()

    def add(self, start: int, rows: torch.Tensor, layers) -> None:
        """Rows [n, W] of positions start..start + n - 1, from one forward. Rows of other layers than those given
        before (a drafter reading other layers swapped in) replace those: the positions before them become holes."""
        layers = tuple(int(i) for i in layers)
        if layers != self.layers:
            self.parts, self.layers = [], layers
        if rows.shape[0]:
            self.parts.append((int(start), rows))

    def assemble(self, fed: int) -> tuple[torch.Tensor | None, int, dict[str, int]]:
        """(rows [R, W] of positions start..fed - 1, start, counts): the longest run without a hole that ends at
        position `fed` - 1 (the last one fed to the target), or (None, fed, counts) when that position has none.
        counts: `recomputed` rows given again, `missing` positions below `fed` without a row (holes)."""
        counts = {"recomputed": 0, "missing": fed}
        if not self.parts or fed <= 0:
            return None, fed, counts
        width, dtype = self.parts[0][1].shape[1], self.parts[0][1].dtype
        out = torch.zeros(fed, width, dtype=dtype)
        have = torch.zeros(fed, dtype=torch.bool)
        for start, rows in self.parts:
            end = min(start + rows.shape[0], fed)
            if end <= start:
                continue
            counts["recomputed"] += int(have[start:end].sum())
            out[start:end] = rows[: end - start].to("cpu")
            have[start:end] = True
        counts["missing"] = int((~have).sum())
        if not bool(have[fed - 1]):
            return None, fed, counts
        holes = (~have).nonzero()
        start = int(holes[-1]) + 1 if holes.numel() else 0
        return out[start:], start, counts


def carries(request_id: str, share: float) -> bool:
    """Whether the request `request_id` carries features when a `share` of requests do (0..1): a fixed function of
    the id, so every chunk of a request, and every replica asked the same question, agrees."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share
