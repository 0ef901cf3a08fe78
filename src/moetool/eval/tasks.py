"""Local lm-evaluation-harness tasks that need no download: pick the true continuation of a held-out passage.

Each zoo domain gets a multiple-choice task, ``moetool_cont_<domain>``, built from that domain's held-out text: a
passage's first words are the context, its next words the true continuation, and the distractors are continuations
taken from far-away passages of the same domain's text (so the task measures fit to the text, not which domain a
snippet comes from). Items depend only on the text and the seed. The items are written as JSON lines and the task
is an lm-eval task config (a dict, the same keys as a task YAML), so lm-eval runs it as any other task.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_write_text
from moetool.io.jsontypes import JsonObject

PREFIX = "moetool_cont_"
# a passage is CONTEXT_WORDS of context then CHOICE_WORDS of continuation (about 60 tokens a request: each choice is
# a forward pass of its own); 4 choices: chance is 25 %
CONTEXT_WORDS = 32
CHOICE_WORDS = 10
N_CHOICES = 4
MAX_ITEMS = 200
# the item-building rule's version, in the cache key: bump it when continuation_items changes
FORMAT = 2


@dataclass(frozen=True)
class ContinuationItem:
    """One multiple-choice item: ``choices[gold]`` is the passage's true continuation."""

    context: str
    choices: list[str]
    gold: int

    def to_json(self) -> JsonObject:
        return {"context": self.context, "choices": list(self.choices), "gold": self.gold}


def task_name(domain: str) -> str:
    """The local task of a zoo domain (``code`` → ``moetool_cont_code``)."""
    return f"{PREFIX}{domain}"


def local_domain(task: str) -> str | None:
    """The domain of a local task name, None for any other task."""
    return task.removeprefix(PREFIX) if task.startswith(PREFIX) else None


def min_words() -> int:
    """Words of held-out text a continuation task needs (``2 * N_CHOICES`` passages)."""
    return 2 * N_CHOICES * (CONTEXT_WORDS + CHOICE_WORDS)


def continuation_items(text: str, *, seed: int = 0, max_items: int = MAX_ITEMS) -> list[ContinuationItem]:
    """Multiple-choice items from one domain's held-out text.

    The text is cut into consecutive passages of ``CONTEXT_WORDS + CHOICE_WORDS`` words (whitespace inside a passage
    kept as written). Each passage's distractors are the continuations of ``N_CHOICES - 1`` other passages at least
    two passages away, all different from the true one and from each other (a passage without enough such others is
    skipped); the gold position is drawn from ``seed``.

    Raises:
        MoetoolError: when the text has fewer than ``2 * N_CHOICES`` passages.
    """
    words = text.split()
    span = CONTEXT_WORDS + CHOICE_WORDS
    passages = [words[i : i + span] for i in range(0, len(words) - span + 1, span)]
    if len(passages) < 2 * N_CHOICES:
        raise MoetoolError(
            f"held-out text of {len(words)} words is too short for a continuation task: "
            f"need {min_words()} words ({2 * N_CHOICES} passages of {span})"
        )
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    items = []
    cont = [" " + " ".join(p[CONTEXT_WORDS:]) for p in passages]
    for i in order:
        far = [j for j in range(len(passages)) if abs(j - i) > 1]
        rng.shuffle(far)
        # distractors differ from the truth and from each other (boilerplate repeats in real text)
        conts = list(dict.fromkeys(cont[j] for j in far if cont[j] != cont[i]))[: N_CHOICES - 1]
        if len(conts) < N_CHOICES - 1:
            continue
        gold = rng.randrange(N_CHOICES)
        conts.insert(gold, cont[i])
        items.append(ContinuationItem(" ".join(passages[i][:CONTEXT_WORDS]), conts, gold))
        if len(items) == max_items:
            break
    return items


def task_config(domain: str, data_file: Path) -> JsonObject:
    """The lm-eval task config (what a task YAML holds) of a domain's items in ``data_file`` (JSON lines)."""
    return {
        "task": task_name(domain),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "fewshot_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        # the choices carry their own leading space
        "target_delimiter": "",
        "fewshot_delimiter": "\n\n",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0, "description": f"true continuation of held-out {domain} text among distractors"},
    }


def write_local_tasks(texts: Mapping[str, str], cache: Path, *, seed: int = 0) -> dict[str, JsonObject]:
    """Write each domain's items under ``cache`` (named by a hash of the text and seed) and return the task configs.

    Returns:
        task name → lm-eval task config.
    """
    configs = {}
    for domain, text in texts.items():
        # the file name covers everything the items depend on: a change of the passage settings is a new file
        spec = f"{FORMAT}:{CONTEXT_WORDS}+{CHOICE_WORDS}x{N_CHOICES}:{MAX_ITEMS}:{seed}"
        digest = hashlib.sha256(f"{spec}\n{text}".encode()).hexdigest()[:16]
        path = cache / f"{task_name(domain)}-{digest}.jsonl"
        if not path.is_file():
            lines = (json.dumps(it.to_json(), ensure_ascii=False) for it in continuation_items(text, seed=seed))
            atomic_write_text(path, "\n".join(lines) + "\n")
        configs[task_name(domain)] = task_config(domain, path)
    return configs
