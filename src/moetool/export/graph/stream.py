"""An ExportLM read from its checkpoint one decoder layer at a time: what a streamed graph export builds its artifact
from (ONNX writes each layer's weights as it is read, Core ML converts a few layers per package).

The transformers model is built on ``meta`` and read as :mod:`moetool.compute.stream` reads it for a streamed
evaluation (transformers' own renames and conversions, cast to float32). The weights outside the layer stack are
read once; :meth:`StreamedExport.block` reads one layer and gives its export block (sharing the layer's memory),
:meth:`StreamedExport.drop` gives the layer's memory back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moetool.compute.stream import MetaModel
    from moetool.export.graph.model import Block, ExportLM

__all__ = ["StreamedExport", "streamed_export_model"]


@dataclass
class StreamedExport:
    """``em``: the ExportLM with the weights outside the layer stack read (embedding, final norm, head, rotary
    tables) and every decoder layer on ``meta``; ``meta`` the transformers model under it and its loader."""

    meta: MetaModel
    em: ExportLM

    @property
    def n_layers(self) -> int:
        return self.em.n_layers

    def block(self, index: int) -> Block:
        """Decoder layer ``index`` read from the checkpoint (float32), as its export block."""
        self.meta.loader.load(self.meta.layer_keys.get(index, []))
        return self.em.block_of(self.meta.layers[index])

    def drop(self, index: int) -> None:
        """Give layer ``index``'s memory back (its blocks must be dropped by the caller too)."""
        from moetool.compute.stream import give_back_freed_memory

        self.meta.layers[index].to("meta")
        give_back_freed_memory()


def streamed_export_model(model_dir: Path) -> StreamedExport:
    """The model in ``model_dir`` ready to be read layer by layer; only the weights outside the layer stack are read.

    Raises:
        MoetoolError: no safetensors, or a tensor outside the layers missing.
        ValueError: a model type no graph target exports (from :class:`ExportLM`).
    """
    from moetool.compute.stream import meta_causal_lm
    from moetool.export.graph.model import ExportLM

    meta = meta_causal_lm(Path(model_dir), torch.float32)
    meta.load_outside()
    return StreamedExport(meta, ExportLM(meta.model).eval())
