"""CoMiGS end to end: assemble the per-user models, train them federated, write them with a report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import copy_tokenizer
from moetool.methods.base import MethodPlan
from moetool.methods.comigs.assemble import PARITY_TOL, base_config, build_user_model, count_params, load_dense
from moetool.methods.comigs.bilevel import ClientTrainer
from moetool.methods.comigs.federated import Federation, RoundRecord, prepare, run_inprocess, variant_recipe
from moetool.recipe.comigs import ComigsRecipe
from moetool.recipe.kept import write_kept_recipe


def save_user(client: ClientTrainer, out: Path, tokenizer_dir: Path) -> float:
    """Save one user's model and check it reloads through ``AutoModelForCausalLM`` to the same logits.

    Returns the max |Δlogit| of the reload on a test window.

    Raises:
        MoetoolError: the reload differs by more than 1e-5.
    """
    from transformers import AutoModelForCausalLM

    import moetool.methods.comigs.model  # noqa: F401  (registers its model class)

    client.model.save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir, out)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    client.model.eval()
    ids = client.data.test[: client.cfg.seq_len].unsqueeze(0)
    with torch.inference_mode():
        diff = float((reloaded(input_ids=ids).logits - client.model(input_ids=ids).logits).abs().max())
    if not diff <= PARITY_TOL:
        raise MoetoolError(f"{out.name}: the saved model reloads with logits {diff:.3g} away from the trained one")
    return diff


def describe(recipe: ComigsRecipe, recipe_dir: Path | None) -> MethodPlan:

    cfg = base_config(recipe, recipe_dir)
    counts = count_params(recipe, cfg)
    t = recipe.training
    lines = [
        f"comigs {recipe.name}: base {recipe.base_model} ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size})",
        f"LoRA r={recipe.lora.rank} α={recipe.lora.alpha:g} (rsLoRA γ={recipe.lora.alpha / recipe.lora.rank**0.5:.3f})"
        f" on {', '.join(recipe.lora.targets)}: {counts['expert_lora']:,} parameters per expert; attention LoRA "
        f"r={recipe.lora.attention_rank}: {counts['attention_lora']:,} "
        f"({'shared' if recipe.lora.share_attention else 'local'})",
        f"generalists (averaged every round): {', '.join(g.name for g in recipe.generalists) or 'none'}; "
        f"routing: {recipe.routing}",
        f"training: {t.rounds} rounds × {t.local_iterations} expert iterations; {t.router_steps} router steps on the "
        f"{t.router_split} split every {t.router_every} iterations; batch {t.batch_size}×{t.seq_len}",
    ]
    for u in recipe.users:
        c = counts["users"][u.name]
        lines.append(
            f"  user {u.name}: {c['experts']} experts (top-{c['top_k']}), specialists "
            f"{', '.join(s.name for s in u.specialists) or 'none'}, router {c['router']:,} params, upload "
            f"{c['upload']:,} params/round"
        )
    parameters = {"expert LoRA": counts["expert_lora"], "attention LoRA": counts["attention_lora"]}
    return MethodPlan("comigs", recipe.name, {"base": str(recipe.base_model)}, parameters, tuple(lines))


def assemble(
    recipe: ComigsRecipe, recipe_dir: Path, output: Path, *, force: bool = False, console: Console | None = None
) -> Path:
    """Untrained per-user models (``output/<user>``); with fresh LoRA each equals the base (checked ≤ 1e-5)."""

    dense, _tok, base_path = load_dense(recipe, recipe_dir)
    with atomic_dir(Path(output), force=force) as tmp:
        ids = torch.arange(1, 33).unsqueeze(0) % dense.config.vocab_size
        with torch.inference_mode():
            ref = dense(input_ids=ids).logits
        report = {}
        for user in recipe.users:
            model = build_user_model(recipe, user, dense, recipe_dir).eval()
            with torch.inference_mode():
                diff = float((model(input_ids=ids).logits - ref).abs().max())
            fresh = all(e.adapter is None for e in [*recipe.generalists, *user.specialists])
            if fresh and not diff <= PARITY_TOL:
                raise MoetoolError(f"users: {user.name}'s untrained model differs from the base by {diff:.3g}")
            model.save_pretrained(str(tmp / user.name))
            copy_tokenizer(base_path, tmp / user.name)
            report[user.name] = {"max_abs_logit_diff_vs_base": diff, "fresh_lora": fresh}
            if console is not None:
                console.print(f"{user.name}: {model.config.n_experts} experts, vs base max |Δlogit| {diff:.2e}")
        write_kept_recipe(tmp, recipe)
        (tmp / "comigs-assemble.json").write_text(json.dumps(report, indent=2) + "\n")
    return Path(output)


class UserResult(TypedDict):
    """One user's line of ``comigs-report.json``."""

    test_ppl_before: float
    test_ppl: float
    experts: list[str]
    train_tokens: int
    reload_max_abs_logit_diff: float


class TrainReport(TypedDict):
    """``comigs-report.json`` of an in-process run."""

    recipe: str
    variant: str
    engine: str
    seconds: float
    upload_bytes_per_round: int
    users: dict[str, UserResult]
    history: list[RoundRecord]


def _comm_bytes(fed: Federation) -> int:
    return sum(sum(t.numel() * t.element_size() for t in c.shared_state().values()) for c in fed.clients)


def train(
    recipe: ComigsRecipe,
    recipe_dir: Path | None,
    output: Path,
    *,
    variant: str = "comigs",
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> TrainReport:
    """Federated training in one process; writes ``output/<user>`` models and ``output/comigs-report.json``."""

    check_output(Path(output), force=force)
    r = variant_recipe(recipe, variant)
    fed = prepare(r, recipe_dir)
    before = {u.name: c.perplexity() for u, c in zip(r.users, fed.clients, strict=True)}
    t0 = time.perf_counter()
    run_inprocess(fed, log=log)
    seconds = time.perf_counter() - t0
    users: dict[str, UserResult] = {}
    report: TrainReport = {
        "recipe": r.name,
        "variant": variant,
        "engine": "inprocess",
        "seconds": seconds,
        "upload_bytes_per_round": _comm_bytes(fed),
        "users": users,
        "history": fed.history,
    }
    with atomic_dir(Path(output), force=force) as tmp:
        for u, c in zip(r.users, fed.clients, strict=True):
            diff = save_user(c, tmp / u.name, fed.base_path)
            users[u.name] = {
                "test_ppl_before": before[u.name],
                "test_ppl": c.perplexity(),
                "experts": c.model.config.expert_names,
                "train_tokens": len(c.data.train),
                "reload_max_abs_logit_diff": diff,
            }
        write_kept_recipe(tmp, r)
        (tmp / "comigs-report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


class ComigsAssembler:
    """The comigs :class:`~moetool.methods.base.Assembler`: :func:`describe` and :func:`assemble` for its plugin."""

    def describe(self, recipe: ComigsRecipe, *, recipe_dir: Path) -> MethodPlan:
        return describe(recipe, recipe_dir)

    def assemble(
        self, recipe: ComigsRecipe, *, recipe_dir: Path, output: Path, force: bool = False, console: Console | None
    ) -> Path:
        return assemble(recipe, recipe_dir, output, force=force, console=console)
