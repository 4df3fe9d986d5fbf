"""What a model's files on disk must be before a library reads them: a Hugging Face model directory (a config.json in
it) and a GGUF file (the GGUF magic first). Checked with the path alone, no torch or transformers loaded, so a command
line naming a wrong path is answered before its model libraries load (`dvi.cli.args`); `dvi.models` checks the same
way before it loads. Raises DviError naming the path; knows nothing of weights or tokenizers."""

from __future__ import annotations

from pathlib import Path

from dvi.errors import DviError


def require_model_dir(path: str | Path, what: str) -> Path:
    """`path` as a Hugging Face model directory (`what`: "target", "drafter", ...), or DviError."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise DviError(f"{what} path {str(p)!r} is not a Hugging Face model directory (no config.json there)")
    return p


def require_gguf_file(path: str | Path) -> Path:
    """`path` as an existing file that starts with the GGUF magic, or DviError."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise DviError(f"GGUF file {str(src)!r} not found")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DviError(f"{str(src)!r} is not a GGUF file (it does not start with the GGUF magic)")
    return src
