"""PEFT LoRA adapter → GGUF adapter, checked in llama.cpp (``lora_path``) against the base with the LoRA merged in.

llama.cpp scales an adapter by ``alpha / rank`` (``adapter.lora.alpha``), which is PEFT's plain LoRA scaling. For
rsLoRA (α/√r) and per-module rank or alpha patterns the PEFT scaling of each module is folded into its B matrix and
alpha is written as 0 (llama.cpp then applies the user's ``lora_scale`` alone), which is exact.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch

from moetool import __version__
from moetool.export.base import ExportError, write_manifest
from moetool.export.gguf.exporter import GATES
from moetool.export.gguf.layout import plan_layout
from moetool.export.gguf.names import gguf_name, permute_qk
from moetool.export.gguf.verify import compare
from moetool.export.gguf.write import write_gguf
from moetool.export.heldout import held_out_text, model_name
from moetool.export.parity import NOT_VERIFIED, ParityRecord
from moetool.io.atomic import atomic_dir
from moetool.io.checkpoint import Checkpoint
from moetool.io.hashes import sha256_file
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.safe import read_json
from moetool.quant.plan import QuantSpec, resolve

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D) adapters",
}


class AdapterConfig(TypedDict, total=False):
    """The keys of a PEFT ``adapter_config.json`` the conversion reads (the file holds more)."""

    peft_type: str
    lora_alpha: float
    alpha_pattern: dict[str, float]
    rank_pattern: dict[str, int]
    use_rslora: bool
    use_dora: bool
    fan_in_fan_out: bool
    bias: str
    modules_to_save: list[str] | None


def is_adapter(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def read_adapter(adapter_dir: Path) -> tuple[AdapterConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """PEFT config and {HF weight name: (A [r, in], B [out, r])}.

    Raises:
        ExportError: unsupported adapter features, naming them.
    """
    cfg: AdapterConfig = read_json(adapter_dir / "adapter_config.json", what="PEFT adapter config", error=ExportError)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ExportError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r}; only LORA adapters convert")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ExportError(f"{adapter_dir}: {what} have no llama.cpp equivalent")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ExportError(f"{adapter_dir}: trained biases or modules_to_save are not LoRA factors; merge them instead")
    files = sorted(adapter_dir.glob("adapter_model*.safetensors"))
    if not files:
        raise ExportError(f"{adapter_dir}: no adapter_model.safetensors (pickle adapters are not read)")
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in raw.items():
        m = _KEY.match(k)
        if m is None:
            raise ExportError(
                f"{adapter_dir}: tensor {k!r} is not a LoRA A/B factor (embedding LoRA or extra weights?)"
            )
        pairs.setdefault(m["module"] + ".weight", {})[m["ab"]] = v.float()
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ExportError(f"{adapter_dir}: {name} has only lora_{''.join(ab)}")
        out[name] = (ab["A"], ab["B"])
    return cfg, out


def module_scaling(cfg: AdapterConfig, name: str, rank: int) -> float:
    """PEFT's scaling for one module (rank/alpha patterns and rsLoRA included)."""
    module = name.removesuffix(".weight")
    alpha = float(cfg.get("lora_alpha", 8))
    for pat, a in (cfg.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pat}$", module):
            alpha = float(a)
    return alpha / (rank**0.5 if cfg.get("use_rslora") else rank)


def _simple(cfg: AdapterConfig) -> bool:
    return not cfg.get("use_rslora") and not cfg.get("rank_pattern") and not cfg.get("alpha_pattern")


def write_adapter(
    adapter_dir: Path,
    base_cfg: Mapping[str, JsonValue],
    base_shapes: dict[str, tuple[int, ...]],
    path: Path,
    out_type: str = "f32",
) -> JsonObject:
    """Write the GGUF adapter; returns facts for the manifest (arch, alpha, tensors)."""
    import gguf

    cfg, pairs = read_adapter(adapter_dir)
    layout = plan_layout(base_cfg, base_shapes)
    permute = {n: t.permute_heads for t in layout.tensors for n in t.sources if t.permute_heads}
    tied = bool(base_cfg.get("tie_word_embeddings"))
    simple = _simple(cfg)
    stacked: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    plain: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for hf, (a, b) in pairs.items():
        if hf not in base_shapes:
            raise ExportError(f"{adapter_dir}: adapter targets {hf}, which the base model does not have")
        if hf == "lm_head.weight" and tied:
            raise ExportError("LoRA on lm_head of a model with tied embeddings has no GGUF tensor to attach to")
        mapped = gguf_name(hf)
        if mapped is None or mapped[0].startswith("token_embd"):
            raise ExportError(f"{adapter_dir}: no GGUF adapter place for {hf}")
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(base_shapes[hf]):
            raise ExportError(f"{hf}: LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit {base_shapes[hf]}")
        bn: np.ndarray = b.numpy() if simple else b.numpy() * module_scaling(cfg, hf, a.shape[0])
        if hf in permute:
            bn = permute_qk(bn, permute[hf])
        name, expert = mapped
        if expert is None:
            plain[name] = (a.numpy(), bn)
        else:
            stacked.setdefault(name, {})[expert] = (a.numpy(), bn)
    for name, by_e in stacked.items():
        n = layout.n_experts
        if sorted(by_e) != list(range(n)):
            raise ExportError(f"{name}: LoRA on experts {sorted(by_e)} only; llama.cpp needs all {n} (stacked)")
        plain[name] = (np.stack([by_e[e][0] for e in range(n)]), np.stack([by_e[e][1] for e in range(n)]))
    alpha = float(cfg.get("lora_alpha", 8)) if simple else 0.0
    w = gguf.GGUFWriter(str(path), layout.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    dt = np.float16 if out_type == "f16" else np.float32
    for name in sorted(plain):
        fa, fb = plain[name]
        w.add_tensor(f"{name}.lora_a", np.ascontiguousarray(fa, dtype=dt))
        w.add_tensor(f"{name}.lora_b", np.ascontiguousarray(fb, dtype=dt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "llama_cpp_arch": layout.arch,
        "alpha": alpha,
        "scaling_folded_into_b": not simple,
        "modules": [*sorted(pairs)],
        "rank": int(next(iter(pairs.values()))[0].shape[0]),
    }


def merged_checkpoint(base_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """The base with W + scaling·B·A written as a plain checkpoint (the reference llama.cpp is compared with)."""
    from safetensors.torch import save_file

    cfg, pairs = read_adapter(adapter_dir)
    ckpt = Checkpoint(base_dir)
    tensors = {}
    for name in ckpt.tensors:
        t = ckpt.get(name).float()
        if name in pairs:
            la, lb = pairs[name]
            t = t + module_scaling(cfg, name, la.shape[0]) * (lb @ la)
        tensors[name] = t.contiguous()
    ckpt.close()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in base_dir.iterdir():
        if f.is_file() and (
            f.name.startswith("tokenizer")
            or f.name in ("config.json", "special_tokens_map.json", "generation_config.json", "moetool.json")
        ):
            shutil.copy2(f, out / f.name)
    return out


def export_adapter(
    adapter_dir: Path,
    base_dir: Path,
    output: Path,
    *,
    force: bool = False,
    verify: bool = True,
    eval_text: str | None = None,
    out_type: str = "f32",
) -> JsonObject:
    """Write ``output``/{name}.lora.gguf and manifest.json; verify through llama.cpp's ``lora_path``."""

    if out_type not in ("f32", "f16"):
        raise ExportError(f"adapter type {out_type!r}: adapters are written f32 or f16")
    base = Checkpoint(base_dir)
    shapes = {n: t.shape for n, t in base.tensors.items()}
    fname = f"{adapter_dir.resolve().name}.lora.gguf"
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp:
        facts = write_adapter(adapter_dir, base.config, shapes, tmp / fname, out_type)
        parity: ParityRecord | str = NOT_VERIFIED
        if verify:
            from moetool.export.gguf.tokenizer import read_vocab

            # inside the output's temporary folder (swept after a kill), not $TMPDIR
            with tempfile.TemporaryDirectory(prefix=".lora-check-", dir=tmp) as work:
                layout = plan_layout(base.config, shapes)
                plan = resolve(QuantSpec(preset="f32"), [t.entry() for t in layout.tensors])
                base_gguf = Path(work) / "base.f32.gguf"
                write_gguf(
                    base_gguf,
                    ckpt=base,
                    cfg=base.config,
                    layout=layout,
                    plan=plan,
                    vocab=read_vocab(base_dir, int(base.config["vocab_size"])),
                    name=model_name(base_dir),
                )
                ref = merged_checkpoint(base_dir, adapter_dir, Path(work) / "merged")
                text, source = held_out_text(base_dir, eval_text)
                report = compare(base_gguf, ref, text, lora_path=tmp / fname)
            worst = max(report.max_abs_logit_diff.values())
            gate = GATES[out_type]
            if worst > gate or not report.tokenizer_match:
                raise ExportError(
                    f"LoRA parity failed: max |Δlogit| {worst:.3g} > {gate:g} (llama.cpp lora_path vs merged)"
                )
            reference = "transformers float32, LoRA merged into the weights"
            parity = replace(report.record(), reference=reference, text=source, tolerance=gate, verdict="pass")
        base.close()
        manifest: JsonObject = {
            "format": "moetool-artifact/1",
            "target": "gguf-lora",
            "file": fname,
            **facts,
            "adapter": {
                "path": str(adapter_dir),
                "files": {f.name: sha256_file(f) for f in adapter_dir.glob("adapter_model*.safetensors")},
            },
            "base_model": {
                "path": str(base_dir),
                "weights_sha256": {f.name: sha256_file(f) for f in base.weight_files},
            },
            "artifact": {"bytes": (tmp / fname).stat().st_size, "sha256": sha256_file(tmp / fname)},
            "plan": {"label": out_type},
            "parity": parity.to_json() if isinstance(parity, ParityRecord) else parity,
            "timing_s": {"total": round(time.perf_counter() - t0, 3)},
            "moetool": __version__,
        }
        write_manifest(tmp, manifest)
    return manifest
