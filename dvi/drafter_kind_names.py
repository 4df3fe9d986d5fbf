"""The names of the kinds of drafter dvi knows: what dvi_drafter.json, `model.drafter_kind`, `Drafter.kind` and
`dvi drafter init --kind` say.

Each name has its `dvi.drafter_kinds.DrafterKind` (`dvi.drafter_kinds.KINDS` holds one per name here). The names live
apart, importing nothing, so that the config's checks (`dvi.config`) and the command line's choices (`dvi.cli`) name
them without loading a model library. This module knows the names only; not what a kind is.
"""

from __future__ import annotations

LAYERS = "layers"  # a layer drafter (a plain causal LM: vLLM's method draft_model)
EAGLE3 = "eagle3"  # an EAGLE-3 drafter (`dvi.eagle3`: vLLM's method eagle3)
KIND_NAMES: tuple[str, ...] = (LAYERS, EAGLE3)
