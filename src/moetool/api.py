"""The small Python API behind the CLI (usable from notebooks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from moetool.methods import METHODS, MergePlan
from moetool.recipe.load import load_recipe


def plan_merge(recipe_path: str | Path, *, allow_pickle: bool = False) -> MergePlan:
    """Validate the recipe and run preflight: no output is touched."""
    path = Path(recipe_path)
    recipe: Any = load_recipe(path)
    return METHODS[recipe.method].plan(recipe, recipe_dir=path.parent, allow_pickle=allow_pickle)


def assembler_for(recipe_path: str | Path) -> tuple[Any, Any]:
    """The recipe's assembler (methods that build a model directly, see :class:`moetool.methods.Assembler`), or
    ``(None, recipe)`` for tensor-plan methods."""
    from moetool.methods import get_assembler

    recipe: Any = load_recipe(Path(recipe_path))
    return get_assembler(recipe.method), recipe


def merge(
    recipe_path: str | Path,
    output: str | Path,
    *,
    force: bool = False,
    allow_pickle: bool = False,
    console: Console | None = None,
) -> Path:
    """Plan and execute a merge (or run the method's assembler); returns the output directory."""
    from moetool.merge import execute

    assembler, recipe = assembler_for(recipe_path)
    if assembler is not None:
        return Path(
            assembler.assemble(
                recipe, recipe_dir=Path(recipe_path).parent, output=Path(output), force=force, console=console
            )
        )
    plan = plan_merge(recipe_path, allow_pickle=allow_pickle)
    text = Path(recipe_path).read_text(encoding="utf-8")
    return execute(plan, Path(output), force=force, recipe_text=text, console=console)


def model_quant_spec(model_dir: Path) -> Any:
    """The ``quantization:`` section of the recipe a model was merged from (kept as moetool-recipe.yaml), if any."""
    import yaml

    from moetool.quant.plan import QuantSpec

    path = Path(model_dir) / "moetool-recipe.yaml"
    if not path.is_file():
        return None
    section = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("quantization")
    return None if section is None else QuantSpec.model_validate(section)


# moetool's own outputs that the standard exporters cannot read, and what exports them (model_type or marker file).
METHOD_EXPORTS: dict[str, str] = {
    "moetool_gem": "moetool gem export MODEL -o DIR (token-level GEM: router and threshold inside the graph)",
    "gem.json": "moetool gem export MODEL -o DIR (sequence-level GEM: router artifact + one artifact per pathway)",
    "moetool_routed_embedding": "moetool embedding export MODEL --target onnx|tflite|coreml -o DIR",
    "moetool_comigs": "moetool comigs bake USER_DIR -o MIXTRAL_DIR (exact), then moetool export MIXTRAL_DIR",
}


def _refuse_method_output(model_dir: Path) -> None:
    """Name the right command when ``model_dir`` is a method's own model class or bundle."""
    from moetool.export import ExportError

    cfg = model_dir / "config.json"
    key = json.loads(cfg.read_text(encoding="utf-8")).get("model_type") if cfg.is_file() else None
    if key not in METHOD_EXPORTS:
        key = next((k for k in METHOD_EXPORTS if k.endswith(".json") and (model_dir / k).is_file()), None)
    if key is not None:
        raise ExportError(f"{model_dir} is a {key.removesuffix('.json')} model; export it with: {METHOD_EXPORTS[key]}")


def plan_export(
    model: str | Path,
    output: str | Path,
    *,
    target: str | None = None,
    quant: Any = None,
    device: str | None = None,
    force: bool = False,
    verify: bool = True,
    eval_text: str | None = None,
    context: int | None = None,
) -> tuple[Any, Any, Any]:
    """Resolve target, quantization plan and memory estimate without writing: (exporter, request, plan).

    ``quant`` is a :class:`~moetool.quant.plan.QuantSpec`, ``--quant`` text, or None for the model's recipe section
    (else f16, or the device's best fitting plan when ``device`` is given).
    """
    from moetool.export import TARGETS, ExportError, ExportRequest, get_exporter
    from moetool.io.sources import resolve_source
    from moetool.quant.devices import get_device
    from moetool.quant.plan import QuantSpec, parse_quant

    model_dir = resolve_source(str(model)).path
    _refuse_method_output(model_dir)
    try:
        spec = parse_quant(quant) if isinstance(quant, str) else quant
        dev = get_device(device) if device is not None else None
    except ValueError as exc:  # pydantic's ValidationError included
        raise ExportError(str(exc)) from None
    if dev is not None:
        if target is None:
            target = next((f for f in dev.formats if f in TARGETS), None)
            if target is None:
                raise ExportError(f"{dev.name} prefers {', '.join(dev.formats)}; none is available yet")
        elif target not in dev.formats:
            raise ExportError(f"{dev.name} runs {', '.join(dev.formats)}, not {target}")
    if spec is None:
        spec = model_quant_spec(model_dir)
    if spec is None:
        spec = QuantSpec() if device is not None else QuantSpec(preset="f16")
    exporter = get_exporter(target or "gguf")  # no device and no target: GGUF
    req = ExportRequest(
        model_dir=model_dir,
        output=Path(output),
        quant=spec,
        device=device,
        verify=verify,
        force=force,
        eval_text=eval_text,
        context=context,
    )
    return exporter, req, exporter.plan(req)


def adapter_base(adapter: Path, base: str | Path | None) -> Path:
    """The base model of a PEFT adapter: ``base`` if given, else its ``base_model_name_or_path`` (resolved locally)."""
    import json

    from moetool.io.sources import resolve_source

    ref = base or json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not ref:
        from moetool.export import ExportError

        raise ExportError(f"{adapter}: the adapter names no base model; pass --base")
    return resolve_source(str(ref), relative_to=Path(adapter)).path


def export(
    model: str | Path, output: str | Path, *, console: Console | None = None, base: str | Path | None = None, **kw: Any
) -> dict[str, Any]:
    """Plan, write, verify and describe one artifact; returns its manifest (also written next to it).

    A PEFT adapter directory as ``model`` becomes a GGUF LoRA adapter for ``base``.
    """
    from moetool.export.gguf.lora import export_adapter, is_adapter

    if is_adapter(Path(model)):
        quant = kw.get("quant") or "f32"
        return export_adapter(
            Path(model),
            adapter_base(Path(model), base),
            Path(output),
            force=kw.get("force", False),
            verify=kw.get("verify", True),
            eval_text=kw.get("eval_text"),
            out_type=str(quant),
        )
    exporter, req, plan = plan_export(model, output, **kw)
    manifest: dict[str, Any] = exporter.export(req, plan, console=console)
    return manifest
