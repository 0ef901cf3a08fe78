"""The ServerApp's side of a round in Flower's deployment engine: waiting for the SuperNodes, and what to do about a
device that does not answer (``on-missing``: fail, drop or wait; ``round-timeout``, ``connect-timeout``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid

MakeMessages = Callable[[list[int]], list[Message]]  # one message per destination node
Setting = str | int | float | bool  # a run-config value (Flower's UserConfigValue)
RunSettings = dict[str, Setting]  # the run's settings: the app factory's defaults and ``flwr run --run-config``


def wait_for_nodes(grid: Grid, n_users: int, timeout: float) -> list[int]:
    """In deployment the SuperNodes connect on their own time: wait until one per user is online."""
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < n_users:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {n_users} SuperNodes connected within {timeout:g} s")
        time.sleep(1)
        nodes = list(grid.get_node_ids())
    return sorted(nodes)[:n_users]


def _ask(grid: Grid, make: MakeMessages, nodes: list[int], timeout: float | None) -> tuple[list[Message], list[str]]:
    """Send ``make(nodes)``; (the good replies, Flower's reasons for the bad ones)."""
    replies = list(grid.send_and_receive(make(nodes), timeout=timeout))
    return [r for r in replies if not r.has_error()], [r.error.reason for r in replies if r.has_error()]


def collect(
    grid: Grid, make: MakeMessages, nodes: list[int], s: RunSettings, label: str, users: dict[int, str]
) -> list[Message]:
    """The good replies to ``make(nodes)``. A device that does not answer (its SuperNode died, or it missed
    ``round-timeout``) or answers with an error fails the run. With ``on-missing = "drop"`` it is left out of this
    and every later round; with ``"wait"`` the round is sent to it again until it answers (a SuperNode restarted
    with its key has its node id back and resumes from its state file), for at most ``connect-timeout`` seconds.
    Nothing is averaged from a failed round, and no device's state is touched by it."""
    timeout = float(s.get("round-timeout") or 0) or None  # None: until Flower's heartbeat marks the node offline
    good, errors = _ask(grid, make, nodes, timeout)
    policy = s.get("on-missing") or "fail"
    deadline = time.monotonic() + float(s.get("connect-timeout") or 600)
    while True:
        answered = {r.metadata.src_node_id for r in good}
        missing = [n for n in nodes if n not in answered]
        if not missing:
            return good
        who = ", ".join(f"SuperNode {n} (user {users.get(n, '? (no reply yet)')})" for n in missing)
        waited = f"at most {timeout:g} s (round-timeout)" if timeout else "until Flower's heartbeat check gave up on it"
        problem = f"{label}: no reply from {who}, waited {waited}" + (f"; errors: {errors[:3]}" if errors else "")
        if policy == "wait" and time.monotonic() < deadline:
            print(f'comigs: {problem}; sending it again (on-missing="wait")', flush=True)
            online = set(grid.get_node_ids())
            back = [n for n in missing if n in online]
            if not back:
                time.sleep(2)
                continue
            more, errors = _ask(grid, make, back, timeout)
            good += more
            if not more:  # e.g. an immediate "node unavailable": do not hammer the SuperLink
                time.sleep(2)
            continue
        if policy != "drop" or len(missing) == len(nodes):
            raise RuntimeError(
                f"{problem}. Nothing of this round was averaged; each device's state (state-dir) still holds its "
                'last completed round. Run config on-missing="drop" goes on without such devices, "wait" sends the '
                "round again until they are back (connect-timeout)."
            )
        print(f'comigs: {problem}; dropped (on-missing="drop")', flush=True)
        return good
