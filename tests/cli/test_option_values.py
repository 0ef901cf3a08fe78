"""What commands do with what they are given: a blank value refused by name (the walk over every command is in
test_option_names.py), the old spellings of renamed options and values, and the export's refusals that a dry run
and --device announce."""

from __future__ import annotations

import json
import warnings

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from moetool import api, registry
from moetool.cli import app
from moetool.cli.options import old_json_file, old_spelling
from moetool.cli.zoo import _zoo_dtype
from moetool.errors import MoetoolDeprecationWarning, MoetoolError

runner = CliRunner()


@pytest.mark.parametrize("args", [["export", "m", "-o", "o", "--target", "  "], ["eval", "zoo:base", "--device", " "]])
def test_a_blank_value_is_refused_too(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and f"{args[-2]} is empty" in r.output


def test_an_empty_default_is_not_a_given_value(tmp_path):
    """The check reads what was given: an option whose default is "" (comigs adapters --base-model) is not refused
    for it."""
    r = runner.invoke(app, ["comigs", "adapters", str(tmp_path / "missing"), "-o", str(tmp_path / "o")])
    assert "is empty" not in r.output


def test_the_export_help_lists_every_registered_target():
    r = runner.invoke(app, ["export", "--help"], terminal_width=400)
    assert r.exit_code == 0
    text = " ".join(r.output.replace("│", " ").split())
    assert ", ".join(registry.TARGETS) in text and "mlx" in registry.TARGETS


def test_export_dry_run_onto_an_existing_output_says_the_real_run_would_be_refused(tmp_path, tiny_models):
    base = tiny_models("llama")["base"]
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["export", str(base), "-o", str(out), "--target", "gguf", "--quant", "q8_0", "--dry-run"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert f"the real run would be refused: {out} exists and is not empty; pass --force to replace it" in said
    assert (out / "keep.txt").read_text() == "mine"
    r = runner.invoke(app, [*args, "--force"])
    assert "would be refused" not in r.output and "--force: the real run replaces" in " ".join(r.output.split())
    (out / "keep.txt").unlink()
    r = runner.invoke(app, args)  # an empty folder is written into
    assert "real run" not in r.output


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto", "mps"])
def test_export_device_given_a_torch_device_says_export_has_no_device(tmp_path, tiny_models, device):
    """``--device cpu`` on export was read as the old --for, and the advice was `write --for cpu`: a torch device
    is no deployment profile."""
    base = tiny_models("llama")["base"]
    r = runner.invoke(app, ["export", str(base), "-o", str(tmp_path / "o"), "--device", device, "--dry-run"])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{device} is a torch device, and `moetool export` has no --device" in said
    assert "the conversion and the parity check run on the CPU" in said
    assert "--for takes a deployment profile" in said and f"--for {device}`" not in said
    assert not (tmp_path / "o").exists()


def test_the_old_json_file_is_read_as_output_with_a_deprecation(tmp_path):
    root = get_command(app)
    with pytest.warns(MoetoolDeprecationWarning, match=r"write `-o r\.json`"):
        assert old_json_file(root, ["eval", "zoo:a", "--json", "r.json"]) == ["eval", "zoo:a", "--output=r.json"]
    with pytest.warns(MoetoolDeprecationWarning):
        assert old_json_file(root, ["-v", "gem", "eval", "m", "--json=r.json"]) == [
            "-v",
            "gem",
            "eval",
            "m",
            "--output=r.json",
        ]
    model = tmp_path / "m"
    model.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the flag: before a model (a folder, zoo:), an option or nothing; and on every other command
        for args in (
            ["eval", "--json", str(model)],
            ["eval", "--json", "zoo:a"],
            ["experts", "list", "m", "--json", "--max-tokens", "3"],
            ["eval", "m", "--json"],
            ["inspect", "m", "--json", "x.json"],
        ):
            assert old_json_file(root, args) == args


def test_inspect_json_is_a_flag_printing_json(tmp_path):
    r = runner.invoke(app, ["profiles", "--json"])
    assert r.exit_code == 0 and r.stdout.lstrip().startswith("{")


def test_the_deployment_profiles_are_listed_by_moetool_profiles_and_devices_is_its_old_name():
    """``--for`` takes a deployment profile, ``--device`` a torch device: the listing of --for's values is named for
    what it lists; the old command name still answers, with one deprecation line."""
    new = runner.invoke(app, ["profiles", "--json"])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old = runner.invoke(app, ["devices", "--json"])
    assert new.exit_code == old.exit_code == 0
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert "raspberry-pi-4" in json.loads(new.stdout)
    assert "`moetool devices` is the old name: write `moetool profiles`" in old.stderr
    commands = get_command(app).commands  # type: ignore[attr-defined]
    assert commands["devices"].hidden and not commands["profiles"].hidden


def test_renamed_options_warn_with_the_new_spelling():
    with pytest.warns(
        MoetoolDeprecationWarning, match=r"`moetool eval --limit 5` is the old spelling: write `--task-limit 5`"
    ):
        assert old_spelling("eval", "--limit", 5, None) == 5
    with pytest.warns(MoetoolDeprecationWarning, match=r"`moetool experts add --no-check` .* write `--no-verify`"):
        assert old_spelling("experts add", "--no-check", True, None) is True


def test_old_and_new_spelling_together_are_refused(tmp_path):
    r = runner.invoke(app, ["eval", "zoo:base", "--limit", "3", "--task-limit", "4"])
    assert r.exit_code == 2 and "--limit is the old spelling of --task-limit" in r.output
    args = ["experts", "extract", str(tmp_path), "0", "-o", str(tmp_path / "o"), "--no-check", "--no-verify"]
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "--no-check is the old spelling of --no-verify" in r.output


def test_zoo_dtype_takes_the_full_names_and_reads_the_short_ones_with_a_deprecation():
    assert _zoo_dtype("float32") == "f32" and _zoo_dtype("bfloat16") == "bf16"
    with pytest.warns(MoetoolDeprecationWarning, match=r"write `--dtype bfloat16`"):
        assert _zoo_dtype("bf16") == "bf16"
    with pytest.raises(MoetoolError, match=r"--dtype 'float16': the smollm2 zoo is built in float32 or bfloat16"):
        _zoo_dtype("float16")


def test_api_export_reads_the_old_device_keyword_with_a_deprecation_warning(tmp_path, tiny_models):
    base = tiny_models("llama")["base"]
    new = api.plan_export(base, tmp_path / "a", for_="raspberry-pi-4", quant="q8_0")
    with pytest.warns(DeprecationWarning, match=r"write for_='raspberry-pi-4'"):
        old = api.plan_export(base, tmp_path / "b", device="raspberry-pi-4", quant="q8_0")
    assert old.request.device == new.request.device == "raspberry-pi-4"
    with pytest.raises(MoetoolError, match="keep for_="):
        api.plan_export(base, tmp_path / "c", device="laptop", for_="laptop")


def test_eval_json_prints_the_report_on_stdout_and_o_writes_it(tmp_path, tiny_models):
    """--json is a flag on eval as everywhere: the report as JSON on stdout, nothing else there; -o FILE writes it."""
    base = tiny_models("llama")["base"]
    (tmp_path / "t.txt").write_text("def main(): return 1\n" * 40)
    args = ["eval", str(base), "--data", f"t={tmp_path / 't.txt'}", "--seq-len", "16", "--max-tokens", "64"]
    r = runner.invoke(app, [*args, "--json", "-o", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)
    assert printed == json.loads((tmp_path / "r.json").read_text()) and "perplexity" in printed
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the CLI prints moetool's deprecations itself, one line each
        r = runner.invoke(app, [*args, "--json", str(tmp_path / "old.json")])
    assert r.exit_code == 0 and json.loads((tmp_path / "old.json").read_text())["perplexity"], r.output
    assert f"deprecated: `moetool eval --json {tmp_path / 'old.json'}` is the old spelling" in " ".join(
        r.output.split()
    )
