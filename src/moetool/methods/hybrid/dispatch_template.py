"""Reference dispatcher for a moetool hybrid export (copied into the export as dispatch.py).

router.onnx (onnxruntime) picks one expert per request; that expert's GGUF runs in llama.cpp (llama-cpp-python).
Needs only numpy, onnxruntime, tokenizers and llama-cpp-python:

    python dispatch.py EXPORT_DIR "some request text" [--domain NAME] [--max-tokens N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def trained_bos_id(manifest: dict[str, Any], root: Path) -> int:
    """The BOS id every training request started with: the export's record of the training tokenizer's special ids
    (exports before it was recorded: the BOS token named in the copied ``tokenizer_config.json``)."""
    special = manifest.get("router", {}).get("special_ids") or {}
    if special.get("bos_token_id") is not None:
        return int(special["bos_token_id"])
    from tokenizers import Tokenizer

    folder = root / manifest["tokenizer"]
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    bos_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(bos) if bos else None
    if bos_id is None:
        raise SystemExit(f"{folder}: no BOS token in tokenizer_config.json; re-export with moetool export")
    return int(bos_id)


def request_ids(tokenizer: Any, text: str, bos_id: int) -> list[int]:
    """``[bos_id, *ids]``: a request as training built it (``moetool.train.data.tokenize_stream``, no special tokens,
    then the BOS in front)."""
    return [bos_id, *tokenizer.encode(text, add_special_tokens=False).ids]


class Dispatcher:
    def __init__(self, root: str | Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.root = Path(root)
        self.manifest = json.loads((self.root / "manifest.json").read_text(encoding="utf-8"))
        router = self.manifest["router"]
        if not router.get("self_contained"):
            raise SystemExit(
                "this router takes feature vectors (token routing or encoder layers > 0); "
                "build them as moetool.methods.hybrid.router does"
            )
        self.session = ort.InferenceSession(str(self.root / router["file"]), providers=["CPUExecutionProvider"])
        self.domains: list[str] = router["config"]["domains"]
        self.n_domains = int(router["config"]["layout"]["n_domains"])
        self.tokenizer = Tokenizer.from_file(str(self.root / self.manifest["tokenizer"] / "tokenizer.json"))
        self.bos_id = trained_bos_id(self.manifest, self.root)
        self.experts = self.manifest["experts"]
        self._llms: dict[int, Any] = {}

    def ids(self, text: str) -> list[int]:
        """The ids the router was trained on: the training tokenizer's BOS, then the text without special tokens."""
        return request_ids(self.tokenizer, text, self.bos_id)

    def route(self, ids: list[int], domain: str | None = None) -> tuple[int, list[float]]:
        feed: dict[str, Any] = {"input_ids": np.array([ids], dtype=np.int64)}
        if self.n_domains:
            onehot = np.zeros((1, self.n_domains), dtype=np.float32)
            if domain is not None:
                onehot[0, self.domains.index(domain)] = 1.0  # an unknown domain stays all zero
            feed["domain"] = onehot
        scores, choice = self.session.run(["scores", "choice"], feed)
        return int(choice[0]), scores[0].tolist()

    def expert(self, k: int) -> Any:
        if k not in self._llms:
            from llama_cpp import Llama

            e = self.experts[k]
            if not e.get("file"):
                raise SystemExit(f"expert {e['name']} was not exported: {e.get('reason', 'unknown')}")
            self._llms[k] = Llama(
                model_path=str(self.root / e["dir"] / e["file"]), n_ctx=2048, logits_all=True, verbose=False
            )
        return self._llms[k]

    def __call__(self, text: str, domain: str | None = None, max_tokens: int = 0) -> dict[str, Any]:
        t0 = time.perf_counter()
        ids = self.ids(text)
        k, scores = self.route(ids, domain)
        t_route = time.perf_counter() - t0
        llm = self.expert(k)
        llm.reset()
        llm.eval(ids)
        out: dict[str, Any] = {"expert": self.experts[k]["name"], "scores": scores, "tokens": len(ids)}
        if max_tokens:
            new: list[int] = []
            for tok in llm.generate(ids, reset=True, temp=0.0):
                if tok == llm.token_eos() or len(new) >= max_tokens:
                    break
                new.append(tok)
            out["continuation"] = llm.detokenize(new).decode("utf-8", "replace")
        out["router_seconds"] = t_route
        out["seconds"] = time.perf_counter() - t0
        return out


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    domain = argv[argv.index("--domain") + 1] if "--domain" in argv else None
    max_tokens = int(argv[argv.index("--max-tokens") + 1]) if "--max-tokens" in argv else 0
    print(json.dumps(Dispatcher(argv[0])(argv[1], domain, max_tokens), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
