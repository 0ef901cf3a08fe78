"""Run inside .venv-flwr by test_deployment.py: the real ServerApp main and real ClientApp, wired by a grid that loses
one device after round 1 (what a SuperNode dying looks like to the server), once per ``on-missing`` policy ("wait":
the device comes back with an empty memory), and once uninterrupted. Prints one JSON object.

Usage: .venv-flwr/bin/python tests/methods/comigs/deployment_check.py RECIPE.yaml WORK_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from moetool.methods.comigs.device_state import read_meta, state_path
from moetool.methods.comigs.flower import make_client_app, server_main


class LossyGrid:
    """Delivers every message to the real ClientApp of its node, except to ``dead`` from round ``dies_in`` on (no
    reply at all, as after a SIGKILL). With ``restarts``, only that one message is lost: the node then comes back
    with an empty memory (a fresh SuperNode process) and its state directory."""

    def __init__(
        self, recipe: str, work: Path, dead: int | None, dies_in: int, restarts: bool = False, late: bool = False
    ) -> None:
        self.app = make_client_app(recipe=recipe)
        self.work, self.dead, self.dies_in, self.restarts, self.late = work, dead, dies_in, restarts, late
        self.contexts = {n: self.fresh(n) for n in (100, 101)}

    def fresh(self, n: int) -> Context:
        config = {"partition-id": n - 100, "num-partitions": 2, "state-dir": str(self.work / f"node{n - 100}")}
        return Context(run_id=1, node_id=n, node_config=config, state=RecordDict(), run_config={})

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for m in messages:
            rnd = int(m.content["config"].get("round", 0))  # type: ignore[union-attr,call-overload]
            node = m.metadata.dst_node_id
            if node == self.dead and rnd >= self.dies_in:
                if self.late:  # it dies after its round finished (state written), before its reply got out
                    self.app(m, self.contexts[node])
                if self.restarts:
                    self.dead = None
                    self.contexts[node] = self.fresh(node)
                continue
            replies.append(self.app(m, self.contexts[node]))
            if self.late and node == 101 and rnd == self.dies_in:
                replies[-1] = self.app(m, self.contexts[node])  # a second copy of the message, queued meanwhile
        return replies


def attempt(recipe: Path, work: Path, policy: str, dead: int | None = 101, late: bool = False) -> dict[str, Any]:
    grid = LossyGrid(str(recipe), work, dead=dead, dies_in=2, restarts=policy == "wait", late=late)
    ctx = Context(
        run_id=1,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={"recipe": str(recipe), "on-missing": policy, "rounds": 3, "output": ""},
    )
    out: dict[str, Any] = {"policy": policy}
    try:
        report = server_main(grid, ctx, {"recipe": str(recipe), "variant": "comigs"})  # type: ignore[arg-type]
        out |= {"dropped": report.get("dropped"), "users": sorted(report["users"])}
        out["history_users"] = [sorted(h["train_ce"]) for h in report["history"]]
        out["history"] = report["history"]
        out["test_ppl"] = {u: r["test_ppl"] for u, r in report["users"].items()}
    except RuntimeError as e:
        out["error"] = str(e)
    out["rounds_on_disk"] = {
        user: int(read_meta(state_path(work / f"node{i}", user))["round"]) for i, user in enumerate(("a", "b"))
    }
    return out


def main() -> None:
    torch.set_num_threads(1)
    recipe, work = Path(sys.argv[1]), Path(sys.argv[2])
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # what a ServerApp process has set
    result = [attempt(recipe, work / policy, policy) for policy in ("fail", "drop", "wait")]
    result.append(attempt(recipe, work / "wait-late", "wait", late=True))
    result.append(attempt(recipe, work / "uninterrupted", "fail", dead=None))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
