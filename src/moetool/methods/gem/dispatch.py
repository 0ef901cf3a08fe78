"""Reference dispatcher for a sequence-level GEM export (what an on-device runtime does, in ~60 lines of Python).

1. read ``manifest.json``; tokenize the prompt with ``tokenizer.json`` and prepend the BOS the manifest records
   (what router training did);
2. run ``router.onnx`` on (input_ids, position_ids 0..T-1, additive causal mask): it returns P(d|x) and the route,
   the threshold rule already applied (0 = general, d+1 = domains[d]);
3. load the chosen pathway's artifact (``pathways/<name>/``, any exported format) and generate with it.

Only the router and one pathway are resident at a time. Needs onnxruntime and tokenizers (no torch, no moetool).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Decision:
    pathway: str  # "general" or a domain name
    probs: dict[str, float]  # P(d|x) per domain
    artifact: Path  # the pathway's main file (e.g. model.onnx, model.gguf)
    manifest: dict[str, Any]  # the pathway artifact's own manifest


class GemDispatcher:
    def __init__(self, export_dir: str | Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.root = Path(export_dir)
        found = [self.root / n for n in ("manifest.json", "gem-manifest.json") if (self.root / n).is_file()]
        # exports written before GEM's manifest took the standard name still carry gem-manifest.json
        self.manifest = json.loads((found[0] if found else self.root / "manifest.json").read_text())
        if self.manifest.get("level") != "sequence":
            raise ValueError(f"{self.root}: not a sequence-level GEM export (the token-level graph routes itself)")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.router = ort.InferenceSession(
            str(self.root / self.manifest["router"]["file"]), so, providers=["CPUExecutionProvider"]
        )
        self.tokenizer = Tokenizer.from_file(str(self.root / self.manifest["tokenizer"]))

    def ids(self, text: str) -> list[int]:
        """The ids the router was trained on: the tokenizer's BOS (as recorded in the manifest), then the text's ids
        without special tokens; an older manifest without the record lets the tokenizer add what it adds."""
        if "bos_token_id" not in self.manifest:
            return list(self.tokenizer.encode(text).ids)
        bos = self.manifest["bos_token_id"]
        body = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return body if bos is None else [int(bos), *body]

    def route_ids(self, ids: list[int]) -> tuple[str, dict[str, float]]:
        t = len(ids)
        mask = np.triu(np.full((t, t), -1e9, dtype=np.float32), k=1)[None, None]
        probs, route = self.router.run(
            None,
            {
                "input_ids": np.array([ids], dtype=np.int64),
                "position_ids": np.arange(t, dtype=np.int64)[None],
                "mask": mask,
            },
        )
        names = self.manifest["route_names"]
        return names[int(route[0])], {d: float(p) for d, p in zip(self.manifest["domains"], probs[0], strict=True)}

    def dispatch(self, text: str) -> Decision:
        name, probs = self.route_ids(self.ids(text))
        entry = self.manifest["pathways"][name]
        meta = json.loads((self.root / entry["dir"] / "manifest.json").read_text())
        return Decision(name, probs, self.root / entry["file"], meta)
