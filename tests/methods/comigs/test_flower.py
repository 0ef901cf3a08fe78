"""CoMiGS on Flower (run in .venv-flwr, Flower's own environment): the real ClientApp replies with generalist and
attention-LoRA tensors only, keeps the rest in its node state, and a Flower simulation equals the in-process run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from comigs_fixtures import RECIPE_YAML, tiny_base

from conftest import TEXT

ROOT = Path(__file__).resolve().parents[3]
FLWR_PY = ROOT / ".venv-flwr" / "bin" / "python"

RECIPE = RECIPE_YAML.replace("{name}", "fl")


@pytest.mark.slow
@pytest.mark.skipif(not FLWR_PY.exists(), reason="needs .venv-flwr (bash scripts/setup_comigs.sh)")
def test_flower_client_and_simulation(tmp_path):
    base = tiny_base(tmp_path)
    lines = TEXT.strip().splitlines()
    (tmp_path / "a.txt").write_text("\n\n".join(lines[0] + " " + lines[1] for _ in range(40)))
    (tmp_path / "b.txt").write_text("\n\n".join(lines[2] + " " + lines[1] for _ in range(40)))
    (tmp_path / "r.yaml").write_text(RECIPE.format(base=base))
    proc = subprocess.run(
        [
            str(FLWR_PY),
            str(Path(__file__).with_name("flower_check.py")),
            str(tmp_path / "r.yaml"),
            str(tmp_path / "out"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    # the reply message: one ArrayRecord of exactly what the server sent (generalist + attention LoRA), updated
    assert r["reply_records"] == ["arrays", "metrics"]
    assert r["reply_array_keys"] == r["sent_keys"] and r["reply_changed"]
    assert all(
        ".mlp.experts.0." in k or (".self_attn." in k and k.endswith(("lora_A", "lora_B")))
        for k in r["reply_array_keys"]
    )
    assert not any(".router." in k or ".mlp.experts.1." in k or ".mlp.experts.2." in k for k in r["reply_array_keys"])
    # specialists, routers and optimiser moments stay in the node's state, and its counter survived two rounds
    private = r["private_keys"]
    assert any(".mlp.experts.2." in k for k in private) and any(".router." in k for k in private)
    assert any(k.startswith("expert_opt/") for k in private) and r["iteration"] == 4
    # Flower's simulation engine runs the same algorithm as the in-process runner
    assert r["flower_user_dirs"] == ["a", "b"]
    assert r["flower_upload_bytes"] == r["inprocess_upload_bytes"]
    for user, ppl in r["inprocess_ppl"].items():
        assert abs(r["flower_ppl"][user] - ppl) <= 1e-4 * ppl
