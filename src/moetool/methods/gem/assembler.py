"""``moetool merge`` for ``method: gem``: describe (plan and memory per device, no weights), then assemble.

Token level writes one ``moetool_gem`` checkpoint; sequence level writes a bundle: ``gem.json``, ``router.safetensors``
and ``pathways/<name>/`` (the general model and each expert, unchanged). Both carry ``gem-report.json``: the
assembly parity, the frozen-weight check, the router's held-out accuracy and fallback share per tau, and (token
level) the QAT figures.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import copy_tokenizer
from moetool.methods.gem.pathways import Pathways, resolve_pathways
from moetool.recipe.gem import GemRecipe

PARITY_LIMIT = 1e-4  # max |Δlogit| of a forced pathway against its source model (float32, same ops)
REPORT = "gem-report.json"
BUNDLE = "gem.json"


def _digest(model: torch.nn.Module, skip: str) -> dict[str, str]:
    """sha256 of every parameter whose name does not start with ``skip`` (to prove they did not move)."""
    return {
        n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
        if not n.startswith(skip)
    }


def _meta_model(pw: Pathways, recipe: GemRecipe) -> Any:
    from moetool.methods.gem.model import GemForCausalLM
    from moetool.methods.gem.pathways import token_config

    with torch.device("meta"):
        return GemForCausalLM(token_config(pw, recipe))


def memory_table(pw: Pathways, recipe: GemRecipe) -> dict[str, Any]:
    """The hybrid plan by role and, per device profile, the memory estimate (weights + KV cache + runtime).

    Token level: every pathway is resident. Sequence level: the router's encoder layers plus the largest pathway
    (one pathway is loaded per input); the plan is the recipe's applied to each pathway checkpoint.
    """
    from moetool.methods.gem.qat import gem_plan
    from moetool.quant.devices import estimate_memory, get_device
    from moetool.quant.plan import TensorEntry, resolve

    by_role: dict[str, Any]
    if recipe.level == "token":
        plan = gem_plan(_meta_model(pw, recipe), recipe.quantization)
        weights = plan.total_bytes
        by_role = plan.by_role()
    else:
        from moetool.io.checkpoint import Checkpoint

        per: dict[str, int] = {}
        roles: dict[str, Any] = {}
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
        devices[name] = {
            "context": dev.context,
            "weights": mem.weights,
            "kv_cache": mem.kv_cache,
            "runtime": mem.runtime,
            "total": mem.total,
            "budget": dev.budget,
            "fits": mem.total <= dev.budget,
        }
    return {
        "plan": recipe.quantization.model_dump(exclude_none=True),
        "weights": weights,
        "by_role": by_role,
        "devices": devices,
    }


class GemAssembler:
    """Plugin for ``method: gem``."""

    name = "gem"

    def describe(self, recipe: Any, *, recipe_dir: Path) -> str:
        assert isinstance(recipe, GemRecipe)
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
        lines += [f"warning: {w}" for w in pw.warnings]
        return "\n".join(lines)

    def assemble(
        self, recipe: Any, *, recipe_dir: Path, output: Path, force: bool = False, console: Any = None
    ) -> Path:
        assert isinstance(recipe, GemRecipe)
        console = console or Console(stderr=True)
        check_output(output, force=force)
        console.print(self.describe(recipe, recipe_dir=recipe_dir))
        pw = resolve_pathways(recipe, recipe_dir)
        if recipe.level == "token":
            return assemble_token(recipe, pw, recipe_dir, output, force, console)
        return assemble_sequence(recipe, pw, recipe_dir, output, force, console)


def _tokenizer(pw: Pathways) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pw.general.path))


def _probe(streams: dict[str, tuple[torch.Tensor, torch.Tensor]], bos: int | None, n: int = 64) -> torch.Tensor:
    first = next(iter(streams.values()))[1][: n - 1]
    return torch.cat([torch.tensor([bos]), first])[None] if bos is not None else first[None]


def _recipe_yaml(recipe: GemRecipe) -> str:
    """The validated recipe (defaults filled in); ``moetool gem eval`` reads the domains' held-out text from it."""
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True), sort_keys=False)


def _meta(recipe: GemRecipe, pw: Pathways) -> dict[str, Any]:
    from moetool.card import provenance

    text = _recipe_yaml(recipe)
    srcs = {"general": pw.general} | dict(pw.domains)
    return {
        "method": "gem",
        "name": recipe.name,
        "level": recipe.level,
        "domains": [d.name for d in recipe.domains],
        "tau": recipe.router.tau,
        "provenance": provenance(srcs, text),
    }


def _held_out_ppl(
    model: Any,
    valid: dict[str, torch.Tensor],
    bos: int | None,
    tokens: int,
    seq_len: int = 128,
) -> dict[str, float]:
    """Perplexity per domain on the first ``tokens`` held-out ids, non-overlapping windows (BOS + seq_len − 1)."""
    import math

    out = {}
    body = seq_len - (1 if bos is not None else 0)
    with torch.no_grad():
        for d, ids in valid.items():
            ids = ids[:tokens]
            nll, n = 0.0, 0
            for s in range(0, len(ids) - body + 1, body):
                w = ids[s : s + body]
                w = torch.cat([torch.tensor([bos]), w]) if bos is not None else w
                logits = model(w[None]).logits[0, :-1].float()
                nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
                n += len(w) - 1
            out[d] = round(math.exp(nll / max(n, 1)), 4)
    return out


def assemble_token(recipe: GemRecipe, pw: Pathways, recipe_dir: Path, output: Path, force: bool, console: Any) -> Path:
    from transformers import AutoModelForCausalLM

    from moetool.methods.gem.pathways import build_token_model, fit_scar_centroids, token_parity
    from moetool.methods.gem.qat import apply_fake_quant, gem_plan, quant_bits, run_qat
    from moetool.methods.gem.router import domain_streams, gem_encoder, held_out_probs, tau_table, train_router
    from moetool.train.data import sample_batch

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
    report: dict[str, Any] = {
        "level": "token",
        "notes": notes,
        "assembly_parity": parity,
        "memory": memory_table(pw, recipe),
    }
    if recipe.scar.clusters:
        calib = [
            sample_batch([s[0]], 4, 128, seed=recipe.router.seed, step=i, bos_id=bos)
            for i, s in enumerate(streams.values())
        ]
        fit_scar_centroids(model, calib, recipe.scar.iterations, seed=recipe.router.seed)
        report["scar"] = {"clusters": recipe.scar.clusters, "fitted_on_tokens": sum(c.numel() for c in calib)}
    before = _digest(model, "model.router.")
    router = model.model.router
    for p in model.parameters():
        p.requires_grad_(False)
    router.requires_grad_(True)
    spec = recipe.router
    report["router_training"] = train_router(
        router,
        gem_encoder(model),
        [s[0] for s in streams.values()],
        steps=spec.steps,
        lr=spec.learning_rate,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        seed=spec.seed,
        bos_id=bos,
        log=console.print,
    )
    router.requires_grad_(False)
    moved = [n for n, h in _digest(model, "model.router.").items() if before[n] != h]
    if moved:
        raise MoetoolError(f"router training changed frozen weights: {moved[:3]}")
    report["router_training"]["frozen_unchanged"] = len(before)
    valid = {d: s[1] for d, s in streams.items()}
    probs, labels = held_out_probs(
        router, gem_encoder(model), valid, seq_len=spec.seq_len, max_tokens=spec.eval_tokens, bos_id=bos
    )
    report["router"] = tau_table(probs, labels, spec.tau_grid, list(streams))
    _print_tau(console, report["router"])
    if recipe.qat.steps:
        bits = quant_bits(gem_plan(model, recipe.quantization, fit_rows=False))
        teachers = {
            d: AutoModelForCausalLM.from_pretrained(str(s.path), dtype=torch.float32).eval()
            for d, s in pw.domains.items()
        }
        ev_tokens = min(4096, spec.eval_tokens)

        def ppl_pair() -> dict[str, Any]:
            import copy

            q = copy.deepcopy(model)
            apply_fake_quant(q, bits)
            return {
                "float": _held_out_ppl(model, valid, bos, ev_tokens),
                "fake_quant": _held_out_ppl(q, valid, bos, ev_tokens),
            }

        pre = ppl_pair()
        frozen = _digest(model, "\0")
        report["qat"] = run_qat(
            model, teachers, {d: s[0] for d, s in streams.items()}, recipe.qat, bits, bos_id=bos, log=console.print
        )
        after = _digest(model, "\0")
        from moetool.methods.gem.qat import trainable_names

        train_set = set(trainable_names(model, list(recipe.qat.trainable)))
        moved = [n for n in after if after[n] != frozen[n] and n not in train_set]
        if moved:
            raise MoetoolError(f"QAT changed frozen weights: {moved[:3]}")
        report["qat"] |= {
            "before": pre,
            "after": ppl_pair(),
            "frozen_unchanged": len(after) - len(train_set),
            "eval_tokens_per_domain": ev_tokens,
        }
    with atomic_dir(output, force=force) as tmp:
        model.save_pretrained(str(tmp))
        copy_tokenizer(pw.general.path, tmp)
        (tmp / "moetool.json").write_text(json.dumps(_meta(recipe, pw), indent=2))
        (tmp / "moetool-recipe.yaml").write_text(_recipe_yaml(recipe))
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
    return output


def _print_tau(console: Any, table: dict[str, Any]) -> None:
    console.print(f"router held-out argmax accuracy {table['argmax_accuracy']:.3f} over {table['items']} items")
    for row in table["by_tau"]:
        acc = "-" if row["routed_accuracy"] is None else f"{row['routed_accuracy']:.3f}"
        console.print(
            f"  tau {row['tau']:.2f}: fallback {row['fallback']:.3f}, routed accuracy {acc}, "
            f"correct {row['correct']:.3f}, wrong {row['wrong']:.3f}"
        )


def assemble_sequence(
    recipe: GemRecipe, pw: Pathways, recipe_dir: Path, output: Path, force: bool, console: Any
) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from moetool.methods.gem.router import domain_streams, held_out_probs, hf_encoder, tau_table, train_router

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
    report: dict[str, Any] = {"level": "sequence", "memory": memory_table(pw, recipe)}
    before = _digest(general, "\0")
    report["router_training"] = train_router(
        router,
        featurize,
        [s[0] for s in streams.values()],
        steps=spec.steps,
        lr=spec.learning_rate,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        seed=spec.seed,
        bos_id=bos,
        pool=True,
        log=console.print,
    )
    if _digest(general, "\0") != before:
        raise MoetoolError("router training changed the general model's weights")
    valid = {d: s[1] for d, s in streams.items()}
    probs, labels = held_out_probs(
        router, featurize, valid, seq_len=spec.seq_len, max_tokens=spec.eval_tokens, bos_id=bos, pool=True
    )
    report["router"] = tau_table(probs, labels, spec.tau_grid, list(streams))
    _print_tau(console, report["router"])
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
        (tmp / "moetool-recipe.yaml").write_text(_recipe_yaml(recipe))
        (tmp / "moetool.json").write_text(json.dumps(_meta(recipe, pw), indent=2))
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
        copy_tokenizer(pw.general.path, tmp)
    return output
