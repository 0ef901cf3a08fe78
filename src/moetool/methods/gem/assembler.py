"""``moetool merge`` for ``method: gem``: describe (plan and memory per device, no weights), then assemble.

Token level writes one ``moetool_gem`` checkpoint; sequence level writes a bundle: ``gem.json``, ``router.safetensors``
and ``pathways/<name>/`` (the general model and each expert, unchanged). Both carry ``gem-report.json``: the
assembly parity, the frozen-weight check, the router's held-out accuracy and fallback share per tau, and (token
level) the QAT figures.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from moetool.card import provenance
from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import BUNDLE_LAYOUT, copy_tokenizer
from moetool.methods.base import MethodPlan
from moetool.methods.gem.model import GemForCausalLM
from moetool.methods.gem.pathways import Pathways, build_token_model, resolve_pathways, token_config, token_parity
from moetool.methods.gem.qat import gem_plan
from moetool.methods.gem.records import AssemblyReport, DeviceMemory, MemoryTable
from moetool.methods.gem.router import domain_streams, held_out_probs, hf_encoder, tau_table
from moetool.methods.gem.training import (
    digest,
    fit_scar,
    print_tau,
    token_qat,
    train_recipe_router,
    train_token_router,
)
from moetool.quant.devices import estimate_memory, get_device
from moetool.quant.plan import TensorEntry, resolve
from moetool.recipe.gem import GemRecipe
from moetool.recipe.kept import kept_recipe_text, write_kept_recipe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PARITY_LIMIT = 1e-4  # max |Δlogit| of a forced pathway against its source model (float32, same ops)
REPORT = "gem-report.json"
BUNDLE = "gem.json"


def _meta_model(pw: Pathways, recipe: GemRecipe) -> GemForCausalLM:

    with torch.device("meta"):
        return GemForCausalLM(token_config(pw, recipe))


def memory_table(pw: Pathways, recipe: GemRecipe) -> MemoryTable:
    """The hybrid plan by role and, per device profile, the memory estimate (weights + KV cache + runtime).

    Token level: every pathway is resident. Sequence level: the router's encoder layers plus the largest pathway
    (one pathway is loaded per input); the plan is the recipe's applied to each pathway checkpoint.
    """

    by_role: Mapping[str, object]
    if recipe.level == "token":
        plan = gem_plan(_meta_model(pw, recipe), recipe.quantization)
        weights = plan.total_bytes
        by_role = plan.by_role()
    else:
        from moetool.io.checkpoint import Checkpoint

        per: dict[str, int] = {}
        roles: dict[str, Mapping[str, object]] = {}
        for name, src in [("general", pw.general), *pw.domains.items()]:
            entries = [TensorEntry(n, t.shape) for n, t in Checkpoint(src.path).tensors.items()]
            p = resolve(recipe.quantization, entries)
            per[name] = p.total_bytes
            roles[name] = p.by_role()
        n_layers = int(pw.config["num_hidden_layers"])
        enc = int(per["general"] * recipe.router.encoder_layers / max(1, n_layers))  # encoder layers ≈ pro rata
        weights = max(per.values()) + enc
        by_role = {"pathway_bytes": per, "encoder_bytes_estimate": enc, "by_role": roles}
    devices = {}
    for name in recipe.devices:
        dev = get_device(name)
        mem = estimate_memory(weights, pw.config, dev.context)
        devices[name] = DeviceMemory(
            context=dev.context,
            weights=mem.weights,
            kv_cache=mem.kv_cache,
            runtime=mem.runtime,
            total=mem.total,
            budget=dev.budget,
            fits=mem.total <= dev.budget,
        )
    return MemoryTable(
        plan=recipe.quantization.model_dump(mode="json", exclude_none=True),
        weights=weights,
        by_role=by_role,
        devices=devices,
    )


class GemAssembler:
    """Plugin for ``method: gem``."""

    name = "gem"

    def describe(self, recipe: GemRecipe, *, recipe_dir: Path) -> MethodPlan:
        pw = resolve_pathways(recipe, recipe_dir)
        mem = memory_table(pw, recipe)
        lines = [
            f"gem '{recipe.name}' ({recipe.level} level): general {pw.general.path}",
            *[f"  pathway {d}: {s.path}" for d, s in pw.domains.items()],
            f"router: encoder = general model's first {recipe.router.encoder_layers} layer(s), tau {recipe.router.tau}"
            f" (strict >), {recipe.router.steps} training steps",
            f"SCAR: {'k = ' + str(recipe.scar.clusters) if recipe.scar.clusters else 'off'}; "
            f"QAT: {recipe.qat.steps} steps",
            f"weights under the plan: {mem['weights'] / 1e6:.2f} MB",
        ]
        for dev, m in mem["devices"].items():
            lines.append(
                f"  {dev}: weights {m['weights'] / 1e6:.2f} MB + KV {m['kv_cache'] / 1e6:.2f} MB + runtime "
                f"{m['runtime'] / 1e6:.2f} MB = {m['total'] / 1e6:.2f} MB of {m['budget'] / 1e9:.2f} GB "
                f"({'fits' if m['fits'] else 'DOES NOT FIT'})"
            )
        inputs = {"general": str(pw.general.path)} | {f"pathway {d}": str(src.path) for d, src in pw.domains.items()}
        return MethodPlan("gem", recipe.name, inputs=inputs, lines=tuple(lines), warnings=tuple(pw.warnings))

    def assemble(
        self, recipe: GemRecipe, *, recipe_dir: Path, output: Path, force: bool = False, console: Console | None = None
    ) -> Path:
        console = console or Console(stderr=True)
        check_output(output, force=force)
        console.print(self.describe(recipe, recipe_dir=recipe_dir).render())
        pw = resolve_pathways(recipe, recipe_dir)
        if recipe.level == "token":
            return assemble_token(recipe, pw, recipe_dir, output, force, console)
        return assemble_sequence(recipe, pw, recipe_dir, output, force, console)


def _tokenizer(pw: Pathways) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pw.general.path))


def _probe(streams: dict[str, tuple[torch.Tensor, torch.Tensor]], bos: int | None, n: int = 64) -> torch.Tensor:
    first = next(iter(streams.values()))[1][: n - 1]
    return torch.cat([torch.tensor([bos]), first])[None] if bos is not None else first[None]


def _meta(recipe: GemRecipe, pw: Pathways) -> dict[str, object]:

    text = kept_recipe_text(recipe)
    srcs = {"general": pw.general} | dict(pw.domains)
    # the sequence level is a bundle (gem.json, a router, whole pathway models), exported and packaged whole
    layout = {"layout": BUNDLE_LAYOUT} if recipe.level == "sequence" else {}
    return {
        "method": "gem",
        "name": recipe.name,
        "level": recipe.level,
        **layout,
        "domains": [d.name for d in recipe.domains],
        "tau": recipe.router.tau,
        "provenance": provenance(srcs, text),
    }


def assemble_token(
    recipe: GemRecipe, pw: Pathways, recipe_dir: Path, output: Path, force: bool, console: Console
) -> Path:
    """The token-level GEM model: pathways assembled (parity-checked), SCAR, router, QAT; written atomically."""

    model, notes = build_token_model(pw, recipe)
    tok = _tokenizer(pw)
    bos = tok.bos_token_id
    streams = domain_streams(recipe, tok, recipe_dir)
    parity = token_parity(model, pw, recipe, _probe(streams, bos))
    console.print(
        "assembly parity (forced pathway vs its source, max |Δlogit|): "
        + ", ".join(f"{k} {v:.2e}" for k, v in parity.items())
    )
    if not notes and max(parity.values()) > PARITY_LIMIT:
        raise MoetoolError(f"gem assembly parity failed: {parity} (limit {PARITY_LIMIT})")
    report = AssemblyReport(level="token", notes=notes, assembly_parity=parity, memory=memory_table(pw, recipe))
    if recipe.scar.clusters:
        report["scar"] = fit_scar(model, recipe, streams, bos)
    report["router_training"], report["router"] = train_token_router(model, recipe, streams, bos, console)
    if recipe.qat.steps:
        report["qat"] = token_qat(model, recipe, pw, streams, bos, console)
    with atomic_dir(output, force=force) as tmp:
        model.save_pretrained(str(tmp))
        copy_tokenizer(pw.general.path, tmp)
        (tmp / "moetool.json").write_text(json.dumps(_meta(recipe, pw), indent=2))
        write_kept_recipe(tmp, recipe)
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
    return output


def assemble_sequence(
    recipe: GemRecipe, pw: Pathways, recipe_dir: Path, output: Path, force: bool, console: Console
) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(pw)
    bos = tok.bos_token_id
    streams = domain_streams(recipe, tok, recipe_dir)
    general = AutoModelForCausalLM.from_pretrained(str(pw.general.path), dtype=torch.float32).eval()
    for p in general.parameters():
        p.requires_grad_(False)
    featurize = hf_encoder(general, recipe.router.encoder_layers)
    router = torch.nn.Linear(int(pw.config["hidden_size"]), len(recipe.domains))
    with torch.no_grad():
        router.weight.zero_()
        router.bias.zero_()
    spec = recipe.router
    report = AssemblyReport(level="sequence", memory=memory_table(pw, recipe))
    before = digest(general, "\0")
    report["router_training"] = train_recipe_router(router, featurize, streams, recipe, bos, console, pool=True)
    if digest(general, "\0") != before:
        raise MoetoolError("router training changed the general model's weights")
    valid = {d: s[1] for d, s in streams.items()}
    probs, labels = held_out_probs(
        router, featurize, valid, seq_len=spec.seq_len, max_tokens=spec.eval_tokens, bos_id=bos, pool=True
    )
    report["router"] = table = tau_table(probs, labels, spec.tau_grid, list(streams))
    print_tau(console, table)
    with atomic_dir(output, force=force) as tmp:
        save_file(
            {"weight": router.weight.detach().contiguous(), "bias": router.bias.detach().contiguous()},
            str(tmp / "router.safetensors"),
        )
        for name, src in [("general", pw.general), *pw.domains.items()]:
            dst = tmp / "pathways" / name
            dst.mkdir(parents=True)
            for f in src.path.iterdir():
                if f.is_file() and (f.suffix in (".json", ".safetensors", ".txt", ".model", ".jinja")):
                    shutil.copy2(f, dst / f.name)
        bundle = {
            "format": "moetool-gem-bundle/1",
            "level": "sequence",
            "domains": [d.name for d in recipe.domains],
            "tau": spec.tau,
            "rule": "argmax domain if max P > tau (strict) else general",
            "encoder": {
                "pathway": "general",
                "layers": spec.encoder_layers,
                "pool": "mean",
                "features": "h / rms(h) after the general model's first `layers` layers",
            },
            "router": "router.safetensors",
            "pathways": {n: f"pathways/{n}" for n in ["general", *pw.domains]},
        }
        (tmp / BUNDLE).write_text(json.dumps(bundle, indent=2))
        write_kept_recipe(tmp, recipe)
        (tmp / "moetool.json").write_text(json.dumps(_meta(recipe, pw), indent=2))
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
        copy_tokenizer(pw.general.path, tmp)
    return output
