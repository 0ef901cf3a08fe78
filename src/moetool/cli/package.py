"""``moetool package`` and ``moetool push``: thin Typer commands over :mod:`moetool.package`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import friendly, human, out


@friendly
def package_cmd(
    source: Annotated[Path, typer.Argument(help="Model directory (merged or tuned) or a run directory like out/demo.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (the Hub repository's content).")],
    artifact: Annotated[
        list[Path] | None,
        typer.Option(
            "--artifact", help="`moetool export` output to include (repeatable; default for a run: exports/*)."
        ),
    ] = None,
    eval_json: Annotated[Path | None, typer.Option("--eval", help="`moetool eval -o` report to include.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Directory of PNG plots to include.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Lay out a Hugging Face repository folder: weights, tokenizer, provenance, artifacts, evaluation, model card."""
    from moetool.package.build import build_repo
    from moetool.package.hub import upload_files

    path = build_repo(source, output, artifacts=artifact or [], eval_json=eval_json, plots=plots, force=force)
    files = upload_files(path)
    out.print(
        f"[green]wrote[/] {path} ({len(files)} files, {human(sum(n for _, n in files))}); see {path / 'README.md'}"
    )


@friendly
def push_cmd(
    folder: Annotated[Path, typer.Argument(help="Folder written by `moetool package`.")],
    repo_id: Annotated[str, typer.Option("--repo-id", help="namespace/name on the Hub (created if missing).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (default main).")] = None,
    message: Annotated[str | None, typer.Option("--message", "-m", help="Commit message.")] = None,
    endpoint: Annotated[str | None, typer.Option(help="Hub URL (default HF_ENDPOINT or huggingface.co).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be uploaded; contact nothing.")] = False,
) -> None:
    """Upload a packaged folder to the Hugging Face Hub. The token comes from HF_TOKEN or `hf auth login`."""
    from rich.table import Table

    from moetool.package.hub import push, upload_files

    files = upload_files(folder)
    sent = push(
        folder, repo_id, private=private, revision=revision, commit_message=message, endpoint=endpoint, dry_run=dry_run
    )
    if dry_run:
        t = Table(title=f"would upload to {repo_id} (dry run: nothing sent)")
        t.add_column("path in repo")
        t.add_column("size", justify="right")
        for rel, n in files:
            t.add_row(rel, human(n))
        t.add_row("[bold]total[/]", f"[bold]{human(sum(n for _, n in files))}[/] in {len(files)} files")
        out.print(t)
        return
    from huggingface_hub import constants

    url = f"{(endpoint or constants.ENDPOINT).rstrip('/')}/{repo_id}"
    out.print(f"[green]pushed[/] {len(sent)} files to {url}" + (f" (branch {revision})" if revision else ""))


def register(app: typer.Typer) -> None:
    app.command("package")(package_cmd)
    app.command("push")(push_cmd)
