"""A tiny merged MoE whose tokenizer has a chat template: what questions are asked of (``api.ask``)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from conftest import write_recipe
from moetool.api import assemble

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
PROMPTS = {"code": "def main():", "legal": "Permission is hereby granted", "medical": "acute bronchitis"}


def add_chat_template(model_dir: Path) -> Path:
    """Give ``model_dir``'s tokenizer :data:`TEMPLATE`."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(model_dir))
    return model_dir


def chat_moe(models: dict[str, Path], tmp: Path, experts: tuple[str, ...] = ("code", "legal", "medical")) -> Path:
    """Merge ``models``' e1, e2, … as the named experts (top-2, prompt-initialised) and add the chat template."""
    lines = "".join(
        f"  - {{name: {name}, source: {models[f'e{i}']}, positive_prompts: ['{PROMPTS[name]}']}}\n"
        for i, name in enumerate(experts, 1)
    )
    text = f"name: chat-moe\nmethod: mofe\nbase_model: {models['base']}\nexperts_per_token: 2\nexperts:\n{lines}"
    return add_chat_template(assemble(write_recipe(tmp / "r.yaml", text), tmp / "moe"))
