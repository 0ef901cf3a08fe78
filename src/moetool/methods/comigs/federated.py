"""Federated CoMiGS: the server averages generalist LoRA A and B uniformly each round; the rest stays on devices.

The round logic here is engine-free (plain tensors); :mod:`moetool.methods.comigs.flower` runs the same functions as
a Flower ClientApp/ServerApp, and :func:`run_inprocess` runs them in one process (tests, benchmarks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetool.errors import MoetoolError
from moetool.methods.comigs.assemble import build_user_model, load_dense, shared_names
from moetool.methods.comigs.bilevel import ClientTrainer, UserData
from moetool.recipe.comigs import ComigsRecipe, LoRAExpertSpec, UserSpec
from moetool.train.data import load_source, tokenize_stream

VARIANTS = ("comigs", "2S", "2G", "local", "fedavg", "tr")


def average(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Uniform mean of each tensor over users (not weighted by data size, as the paper).

    Raises:
        ValueError: users disagree on names or shapes.
    """
    if not states:
        raise ValueError("no client states to average")
    keys = set(states[0])
    for i, s in enumerate(states[1:], 1):
        if set(s) != keys:
            raise ValueError(f"client {i} sent different tensors: {sorted(set(s) ^ keys)[:3]}")
        for k in keys:
            if s[k].shape != states[0][k].shape:
                raise ValueError(f"client {i}: {k} has shape {list(s[k].shape)}, client 0 {list(states[0][k].shape)}")
    return {k: torch.stack([s[k].float() for s in states]).mean(dim=0).to(states[0][k].dtype) for k in sorted(keys)}


def variant_recipe(recipe: ComigsRecipe, variant: str) -> ComigsRecipe:
    """The recipe rewritten for a baseline of the paper's Table 2 (same parameter budget: two LoRA experts).

    comigs: as written. 2S: two specialists, no generalist (no communication). 2G: two generalists. local: two
    LoRA modules averaged, no router, nothing shared. fedavg: the same, both shared. tr: routers on the train split.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if variant == "comigs":
        return recipe
    if variant == "tr":
        return recipe.model_copy(update={"training": recipe.training.model_copy(update={"router_split": "train"})})

    def spec(name: str) -> LoRAExpertSpec:
        return LoRAExpertSpec(name=name)

    users = []
    for u in recipe.users:
        own = [spec(f"{u.name}-s1"), spec(f"{u.name}-s2")] if variant in ("2S", "local") else []
        users.append(u.model_copy(update={"specialists": own}))
    gens = [spec("generalist-1"), spec("generalist-2")] if variant in ("2G", "fedavg") else []
    routing = "average" if variant in ("local", "fedavg") else "learned"
    return ComigsRecipe.model_validate(
        recipe.model_dump()
        | {"generalists": [g.model_dump() for g in gens], "routing": routing, "users": [u.model_dump() for u in users]}
    )


def load_user_data(
    recipe: ComigsRecipe, user: UserSpec, tokenizer: PreTrainedTokenizerBase, recipe_dir: Path | None
) -> UserData:
    """Train tokens (offset, capped), their tail ``valid_fraction`` as the router split, held-out text as test."""

    t = recipe.training
    train_text, held = load_source(user.name, user.data, base_dir=recipe_dir, fraction=0.1, seed=t.seed)
    ids = tokenize_stream(tokenizer, train_text)[user.train_offset :]
    if user.max_train_tokens is not None:
        ids = ids[: user.max_train_tokens]
    n_valid = max(t.seq_len + 1, int(len(ids) * t.valid_fraction))
    train, valid = ids[:-n_valid], ids[-n_valid:]
    test = tokenize_stream(tokenizer, held)
    for split, s in (("train", train), ("valid", valid), ("test", test)):
        if len(s) <= t.seq_len:
            raise MoetoolError(
                f"users.{recipe.users.index(user)}.data: the {split} split has {len(s)} tokens, not more than "
                f"training.seq_len {t.seq_len}"
            )
    return UserData(train=train, valid=valid, test=test)


class RoundRecord(TypedDict):
    """One round of the report's history: each user's mean losses of its local round (``train_ce``, …)."""

    round: int
    users: dict[str, dict[str, float]]


@dataclass
class Federation:
    """Everything one run needs: the recipe, the base, and one trainer per user (in recipe order)."""

    recipe: ComigsRecipe
    tokenizer: PreTrainedTokenizerBase
    base_path: Path
    clients: list[ClientTrainer]
    history: list[RoundRecord] = field(default_factory=list)


def make_client(
    recipe: ComigsRecipe,
    index: int,
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe_dir: Path | None,
    data: UserData | None = None,
) -> ClientTrainer:
    user = recipe.users[index]
    model = build_user_model(recipe, user, dense, recipe_dir)
    t = recipe.training
    return ClientTrainer(
        model,
        data if data is not None else load_user_data(recipe, user, tokenizer, recipe_dir),
        t,
        total_iterations=t.rounds * t.local_iterations,
        shared=shared_names(model, recipe),
        bos_id=getattr(tokenizer, "bos_token_id", None),
        seed=t.seed * 101 + index,
    )


def prepare(recipe: ComigsRecipe, recipe_dir: Path | None = None, data: list[UserData] | None = None) -> Federation:
    dense, tok, path = load_dense(recipe, recipe_dir)
    clients = [
        make_client(recipe, i, dense, tok, recipe_dir, None if data is None else data[i])
        for i in range(len(recipe.users))
    ]
    return Federation(recipe, tok, path, clients)


def run_inprocess(fed: Federation, rounds: int | None = None, log: Callable[[str], None] | None = None) -> Federation:
    """Paper Alg. 1 in one process: broadcast → local rounds → uniform average, ``rounds`` times, then a final
    broadcast so every user ends with the averaged generalist."""
    clients = fed.clients
    sharing = [c for c in clients if c.shared]
    server = sharing[0].shared_state() if sharing else {}  # the server's initial generalist (= every device's)
    total = rounds or fed.recipe.training.rounds
    for r in range(total):
        uploads = []
        stats = {}
        for i, c in enumerate(clients):
            if c.shared:
                c.load_shared(server)
            name = fed.recipe.users[i].name
            stats[name] = c.local_round()
            if log is not None:  # one line per user, so a long round is never silent
                log(f"round {r + 1}/{total}, user {name}: train cross-entropy {stats[name]['train_ce']:.3f}")
            if c.shared:
                uploads.append(c.shared_state())
        if uploads:
            server = average(uploads)
        fed.history.append({"round": r + 1, "users": stats})
        if log is not None:
            mean = sum(s["train_ce"] for s in stats.values()) / max(len(stats), 1)
            log(
                f"round {r + 1}/{total}: generalists averaged over {len(uploads)} users; mean train cross-entropy {mean:.3f}"
            )
    for c in sharing:
        c.load_shared(server)
    return fed
