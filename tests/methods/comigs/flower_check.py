"""Run inside .venv-flwr by test_comigs_flower.py: the real ClientApp's replies, and one short Flower simulation
against the in-process runner. Prints one JSON object.

Usage: .venv-flwr/bin/python tests/methods/comigs/flower_check.py RECIPE.yaml OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from moetool.methods.comigs.flower import COUNTERS, PRIVATE, _dense, _initial_shared, _recipe, make_client_app, simulate
from moetool.methods.comigs.pipeline import train


def main() -> None:
    torch.set_num_threads(1)
    recipe_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    recipe = _recipe(str(recipe_path), "comigs")
    dense, _, _ = _dense(str(recipe_path), "comigs")
    server = _initial_shared(recipe, recipe_path.parent, dense)
    app = make_client_app(recipe=str(recipe_path))
    ctx = Context(
        run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    from flwr.supercore.task_identity import TaskIdentity

    # what a ServerApp process has set when it creates messages
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    replies = []
    for rnd in (1, 2):
        msg = Message(
            RecordDict({"arrays": ArrayRecord(server), "config": ConfigRecord({"round": rnd})}),
            dst_node_id=7,
            message_type=MessageType.TRAIN,
        )
        reply = app(msg, ctx)
        replies.append(reply)
    content = replies[-1].content
    arrays = content["arrays"]
    result = {
        "reply_records": sorted(content.keys()),
        "reply_array_keys": sorted(arrays.keys()),
        "reply_metric_keys": sorted(content["metrics"].keys()),
        "sent_keys": sorted(server),
        "reply_changed": any(not torch.equal(arrays.to_torch_state_dict()[k], server[k]) for k in server),
        "private_keys": sorted(ctx.state[PRIVATE].keys()),
        "iteration": int(ctx.state[COUNTERS]["iteration"]),
    }
    sim = simulate(recipe_path, out / "flower", rounds=2)
    ref = train(
        recipe.model_copy(update={"training": recipe.training.model_copy(update={"rounds": 2})}),
        recipe_path.parent,
        out / "inprocess",
    )
    result["flower_ppl"] = {u: v["test_ppl"] for u, v in sim["users"].items()}
    result["inprocess_ppl"] = {u: v["test_ppl"] for u, v in ref["users"].items()}
    result["flower_upload_bytes"] = sim["upload_bytes_per_round"]
    result["inprocess_upload_bytes"] = ref["upload_bytes_per_round"]
    result["flower_user_dirs"] = sorted(p.name for p in (out / "flower").iterdir() if p.is_dir())
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
