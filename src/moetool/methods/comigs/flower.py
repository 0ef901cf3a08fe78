"""CoMiGS on Flower: a ClientApp per user (device) and a ServerApp that averages generalists uniformly.

The same apps run in Flower's simulation engine (:func:`simulate`, N virtual SuperNodes on one machine) and in its
deployment mode (``flower-superlink`` / ``flower-supernode --node-config "partition-id=I"`` / ``flwr run``; see
docs/comigs.md). Each user is the recipe's ``users[partition-id]``. A device keeps its specialists, routers, attention
LoRA (unless shared) and both optimisers' state in its node ``context.state``; its reply carries only
:meth:`ClientTrainer.shared_state` (generalist LoRA A/B and, when shared, attention LoRA) and scalar metrics.

Flower needs its own environment (.venv-flwr, ``bash scripts/setup_comigs.sh``): flwr 1.41 pins protobuf < 7,
typer < 0.21, rich < 15 and packaging < 26, below what moetool's main environment runs; flwr 1.42.0 needs a certifi
release that is not published.
"""

from __future__ import annotations

import json
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from moetool.io.atomic import atomic_write_text
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.methods.comigs.assemble import build_user_model, load_dense, shared_names
from moetool.methods.comigs.bilevel import ClientTrainer, UserData
from moetool.methods.comigs.device_state import DeviceState, load_state, save_state
from moetool.methods.comigs.federated import average, load_user_data, make_client, variant_recipe
from moetool.methods.comigs.flower_replies import RunSettings, Setting
from moetool.methods.comigs.flower_replies import collect as _collect
from moetool.methods.comigs.flower_replies import wait_for_nodes as _wait_for_nodes
from moetool.recipe.comigs import ComigsRecipe

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PRIVATE = "comigs.private"
REPLY_ARRAYS = "comigs.reply.arrays"  # the last train reply, sent again if the server asks for that round again
REPLY_METRICS = "comigs.reply.metrics"
COUNTERS = "comigs.counters"


def _settings(context: Context, defaults: RunSettings) -> RunSettings:
    """Run settings: the factory's defaults, overridden by ``flwr run --run-config`` / pyproject values."""
    out = dict(defaults)
    for key in ("recipe", "variant", "output", "rounds", "round-timeout", "on-missing", "connect-timeout"):
        if key in context.run_config and context.run_config[key] not in ("", None):
            out[key] = context.run_config[key]
    if not out.get("recipe"):
        raise ValueError("run config 'recipe' (path to the comigs recipe) is not set")
    return out


@lru_cache(maxsize=4)
def _recipe(path: str, variant: str) -> ComigsRecipe:
    from moetool.recipe import load_recipe

    r = load_recipe(path)
    if not isinstance(r, ComigsRecipe):
        raise ValueError(f"{path}: method is {getattr(r, 'method', None)!r}, not comigs")
    return variant_recipe(r, variant)


@lru_cache(maxsize=2)
def _dense(path: str, variant: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    return load_dense(_recipe(path, variant), Path(path).parent)


@lru_cache(maxsize=16)
def _data(path: str, variant: str, index: int) -> UserData:
    recipe = _recipe(path, variant)
    _, tok, _ = _dense(path, variant)
    return load_user_data(recipe, recipe.users[index], tok, Path(path).parent)


def _state_dir(context: Context) -> Path | None:
    """``state-dir`` from the SuperNode's ``--node-config``: where this device also keeps its state on disk."""
    value = context.node_config.get("state-dir", "")
    return Path(str(value)) if value else None


def _trainer(context: Context, s: RunSettings, rnd: int) -> tuple[ClientTrainer, int]:
    """This device's trainer for round ``rnd``, restored from its node state after the first round, or, on a
    SuperNode restarted within the same run, from the state file of round ``rnd - 1``."""
    path, variant = str(s["recipe"]), str(s["variant"])
    index = int(context.node_config["partition-id"])
    recipe = _recipe(path, variant)
    if not 0 <= index < len(recipe.users):
        raise ValueError(f"node partition-id {index} has no user (the recipe has {len(recipe.users)})")
    dense, tok, _ = _dense(path, variant)
    trainer = make_client(recipe, index, dense, tok, Path(path).parent, _data(path, variant, index))
    if PRIVATE in context.state:
        record = context.state[PRIVATE]
        counters = context.state[COUNTERS]
        assert isinstance(record, ArrayRecord) and isinstance(counters, ConfigRecord)
        trainer.restore(dict(record.to_torch_state_dict()), {k: int(v) for k, v in counters.items()})  # type: ignore[call-overload]
    elif (state_dir := _state_dir(context)) is not None and rnd > 1:
        saved = load_state(state_dir, recipe.users[index].name)
        if saved is None or saved.run_id != context.run_id or saved.round != rnd - 1:
            found = "none" if saved is None else f"run {saved.run_id} round {saved.round}"
            raise RuntimeError(
                f"user {recipe.users[index].name!r}: round {rnd} needs the state of run {context.run_id} round "
                f"{rnd - 1}, and neither this SuperNode's memory nor {state_dir} holds it (on disk: {found})"
            )
        trainer.restore(saved.tensors, saved.counters)
    return trainer, index


def _persist(trainer: ClientTrainer, context: Context, user: str, rnd: int, reply: RecordDict) -> None:
    """Keep the state for the next round, and this round's reply: in the node's memory and, with ``state-dir``,
    atomically on disk. Called only once the round's training is complete, so a device killed mid-round keeps its
    last completed round."""
    tensors, counters = trainer.private_state()
    context.state[PRIVATE] = ArrayRecord({k: v.contiguous() for k, v in tensors.items()})
    context.state[COUNTERS] = ConfigRecord(dict(counters) | {"round": rnd})
    context.state[REPLY_ARRAYS] = reply["arrays"]
    context.state[REPLY_METRICS] = reply["metrics"]
    if (state_dir := _state_dir(context)) is not None:
        upload = reply["arrays"]
        metrics = reply["metrics"]
        assert isinstance(upload, ArrayRecord) and isinstance(metrics, MetricRecord)
        tensors |= {f"upload/{k}": v for k, v in upload.to_torch_state_dict().items()}
        save_state(state_dir, DeviceState(user, context.run_id, rnd, tensors, dict(counters), dict(metrics)))  # type: ignore[arg-type]


def _earlier_reply(context: Context, user: str, rnd: int) -> RecordDict | None:
    """This device's reply to round ``rnd`` when it has trained that round already. The server sends a round again
    to a device it lost (on-missing="wait"): a reply lost in a crash after the state write, or a second copy still
    queued for a restarted SuperNode, must not train the round twice."""
    counters = context.state.get(COUNTERS) if COUNTERS in context.state else None
    if isinstance(counters, ConfigRecord):
        if int(counters.get("round", 0)) == rnd:  # type: ignore[call-overload]
            return RecordDict({"arrays": context.state[REPLY_ARRAYS], "metrics": context.state[REPLY_METRICS]})
        return None
    state_dir = _state_dir(context)
    saved = load_state(state_dir, user) if state_dir is not None else None
    if saved is None or saved.run_id != context.run_id or saved.round != rnd:
        return None
    upload = {k.removeprefix("upload/"): v for k, v in saved.tensors.items() if k.startswith("upload/")}
    return RecordDict({"arrays": ArrayRecord(upload), "metrics": MetricRecord(saved.reply)})  # type: ignore[arg-type]


def _round(msg: Message) -> int:
    cfg = msg.content["config"]
    assert isinstance(cfg, ConfigRecord)
    return int(cfg.get("round", 1))  # type: ignore[call-overload]


def client_train(msg: Message, context: Context, defaults: RunSettings) -> Message:
    """One round on a device: load the server's generalists, run the local bi-level loop, reply with the shared
    tensors only."""
    s = _settings(context, defaults)
    rnd = _round(msg)
    index = int(context.node_config["partition-id"])
    recipe = _recipe(str(s["recipe"]), str(s["variant"]))
    user = recipe.users[index].name if 0 <= index < len(recipe.users) else ""
    if user and (earlier := _earlier_reply(context, user, rnd)) is not None:
        return Message(earlier, reply_to=msg)
    trainer, index = _trainer(context, s, rnd)
    if trainer.shared:
        arrays = msg.content["arrays"]
        assert isinstance(arrays, ArrayRecord)
        trainer.load_shared(dict(arrays.to_torch_state_dict()))
    stats = trainer.local_round()
    content = RecordDict(
        {
            "arrays": ArrayRecord(trainer.shared_state()),
            "metrics": MetricRecord(
                {"train_ce": stats["train_ce"], "partition-id": index, "iteration": trainer.iteration}
            ),
        }
    )
    _persist(trainer, context, user, rnd, content)
    return Message(content, reply_to=msg)


def client_evaluate(msg: Message, context: Context, defaults: RunSettings) -> Message:
    """Load the final generalists, report test perplexity, and (with ``save-dir``) save this user's model there."""
    s = _settings(context, defaults)
    trainer, index = _trainer(context, s, _round(msg))
    if trainer.shared:
        arrays = msg.content["arrays"]
        assert isinstance(arrays, ArrayRecord)
        trainer.load_shared(dict(arrays.to_torch_state_dict()))
    ppl = trainer.perplexity()
    cfg = msg.content["config"]
    assert isinstance(cfg, ConfigRecord)
    save_dir = str(cfg.get("save-dir", ""))
    if save_dir:
        from moetool.methods.comigs.pipeline import save_user

        recipe = _recipe(str(s["recipe"]), str(s["variant"]))
        _, _, base_path = _dense(str(s["recipe"]), str(s["variant"]))
        save_user(trainer, Path(save_dir) / recipe.users[index].name, base_path)
    content = RecordDict(
        {"metrics": MetricRecord({"test_ppl": ppl, "partition-id": index, "train_tokens": len(trainer.data.train)})}
    )
    return Message(content, reply_to=msg)


def make_client_app(**defaults: Setting) -> ClientApp:
    """A ClientApp; ``defaults`` (recipe, variant) are overridden by the run config in deployment mode."""
    settings: RunSettings = {"recipe": "", "variant": "comigs"}
    defaults = settings | defaults
    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return client_train(msg, context, defaults)

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return client_evaluate(msg, context, defaults)

    return app


def _initial_shared(recipe: ComigsRecipe, recipe_dir: Path, dense: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The server's starting generalists: the seeded initialisation every device also starts from."""
    model = build_user_model(recipe, recipe.users[0], dense, recipe_dir)
    named = dict(model.named_parameters())
    return {n: named[n].detach().clone() for n in shared_names(model, recipe)}


def _send(
    nodes: list[int], arrays: dict[str, torch.Tensor], config: RunSettings, kind: str, group: str
) -> list[Message]:
    return [
        Message(
            RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord(config)}),
            dst_node_id=n,
            message_type=kind,
            group_id=group,
        )
        for n in nodes
    ]


class Rounds(TypedDict):
    """What the federated rounds add to the report: the history, the upload size, the users dropped (each with
    the round it did not answer) and which user each SuperNode runs."""

    history: list[JsonValue]
    upload_bytes_per_round: int
    dropped: dict[str, JsonValue]
    users: dict[int, str]


def _train_rounds(
    grid: Grid, s: RunSettings, recipe: ComigsRecipe, nodes: list[int], server: dict[str, torch.Tensor], rounds: int
) -> tuple[dict[str, torch.Tensor], Rounds]:
    """The federated rounds. Returns the final generalists and the report's history, upload size and drops."""
    users: dict[int, str] = {}
    history: list[JsonValue] = []
    dropped: dict[str, JsonValue] = {}
    upload_bytes = 0
    for r in range(1, rounds + 1):
        make = partial(_send, arrays=server, config={"round": r}, kind=MessageType.TRAIN, group=str(r))
        replies = _collect(grid, make, nodes, s, f"round {r}", users)
        metrics = [rep.content["metrics"] for rep in replies]
        ids = [int(m["partition-id"]) for m in metrics]  # type: ignore[index,call-overload]
        if len(set(ids)) != len(ids):
            raise RuntimeError(f"two SuperNodes run the same user: partition-ids {sorted(ids)} (--node-config)")
        users.update({rep.metadata.src_node_id: recipe.users[i].name for rep, i in zip(replies, ids, strict=True)})
        for n in [n for n in nodes if n not in {rep.metadata.src_node_id for rep in replies}]:
            dropped[users.get(n, f"node {n}")] = r
            nodes.remove(n)
        uploads = [dict(rep.content["arrays"].to_torch_state_dict()) for rep in replies]  # type: ignore[union-attr]
        upload_bytes = sum(t.numel() * t.element_size() for u in uploads for t in u.values())
        if server:
            server = average(uploads)
        ce: dict[str, JsonValue] = {str(i): float(m["train_ce"]) for i, m in zip(ids, metrics, strict=True)}  # type: ignore[index,arg-type]
        history.append({"round": r, "train_ce": ce})
    return server, {"history": history, "upload_bytes_per_round": upload_bytes, "dropped": dropped, "users": users}


def server_main(grid: Grid, context: Context, defaults: RunSettings) -> JsonObject:
    """Rounds of: send the averaged generalists to every user, collect their uploads, average uniformly. Then an
    evaluation round. Writes ``<output>/comigs-report.json`` when an output is set; returns the report."""
    s = _settings(context, defaults)
    path, variant = str(s["recipe"]), str(s["variant"])
    recipe = _recipe(path, variant)
    rounds = int(s.get("rounds") or recipe.training.rounds)
    dense, _, _ = _dense(path, variant)
    server = _initial_shared(recipe, Path(path).parent, dense)
    nodes = _wait_for_nodes(grid, len(recipe.users), float(s.get("connect-timeout") or 600))
    server, done = _train_rounds(grid, s, recipe, nodes, server, rounds)
    out = str(s.get("output") or "")
    config: RunSettings = {"round": rounds + 1, "save-dir": out}
    make = partial(_send, arrays=server, config=config, kind=MessageType.EVALUATE, group="final")
    users: dict[str, JsonValue] = {}
    for rep in _collect(grid, make, nodes, s, "evaluation", done["users"]):
        m = rep.content["metrics"]
        users[recipe.users[int(m["partition-id"])].name] = {  # type: ignore[index,call-overload]
            "test_ppl": float(m["test_ppl"]),  # type: ignore[index,arg-type]
            "train_tokens": int(m["train_tokens"]),  # type: ignore[index,call-overload]
        }
    report: JsonObject = {
        "recipe": recipe.name,
        "variant": variant,
        "engine": "flower",
        "rounds": rounds,
        "upload_bytes_per_round": done["upload_bytes_per_round"],
        "users": users,
        "history": done["history"],
    }
    if done["dropped"]:
        report["dropped"] = done["dropped"]  # user -> the round it did not answer
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out) / "comigs-report.json", json.dumps(report, indent=2) + "\n")
    return report


def make_server_app(**defaults: Setting) -> ServerApp:
    settings: RunSettings = {"recipe": "", "variant": "comigs", "output": "", "rounds": 0}
    defaults = settings | defaults
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        server_main(grid, context, defaults)

    return app


# deployment mode (`flwr run`): everything comes from the run config (see docs/comigs.md)
client_app = make_client_app()
server_app = make_server_app()


def simulate(
    recipe_path: Path, output: Path, *, variant: str = "comigs", rounds: int | None = None, verbose: bool = False
) -> JsonObject:
    """Run the federation in Flower's simulation engine (one virtual SuperNode per user, ray backend, one CPU
    each); writes the user models and ``comigs-report.json`` into ``output`` (a fresh directory)."""
    from flwr.simulation import run_simulation

    recipe = _recipe(str(recipe_path), variant)
    defaults: RunSettings = {
        "recipe": str(Path(recipe_path).resolve()),
        "variant": variant,
        "output": str(Path(output).resolve()),
        "rounds": rounds or 0,
    }
    run_simulation(
        server_app=make_server_app(**defaults),
        client_app=make_client_app(**defaults),
        num_supernodes=len(recipe.users),
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 1, "include_dashboard": False},
        },
        verbose_logging=verbose,
    )
    report_path = Path(output) / "comigs-report.json"
    if not report_path.is_file():
        raise RuntimeError(f"the Flower simulation ended without writing {report_path}")
    report: JsonObject = json.loads(report_path.read_text(encoding="utf-8"))
    return report
