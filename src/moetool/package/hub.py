"""``moetool push``: upload a packaged folder to the Hugging Face Hub (or any endpoint that speaks its API).

The token is never taken on the command line (shell history) and never printed: huggingface_hub reads ``HF_TOKEN``
or the token saved by ``hf auth login``; error messages are built here and scrubbed of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moetool import __version__
from moetool.errors import MoetoolError
from moetool.io.files import is_bundle
from moetool.io.safe import decode_utf8, parse_yaml, read_bytes, read_json


class PushError(MoetoolError):
    """The folder is not ready to upload, or the Hub refused it."""


def _front_matter(readme: Path) -> Mapping[str, object]:
    text = decode_utf8(
        read_bytes(readme, what="model card", error=PushError), readme, what="model card", error=PushError
    )
    head, sep, _ = text.removeprefix("---\n").partition("\n---")
    if not text.startswith("---\n") or not sep:
        raise PushError(f"{readme}: no YAML front matter (write the folder with `moetool package`)")
    # line numbers in errors count from the README's first line: the front matter starts on its second
    data, _ = parse_yaml("\n" + head, readme, what="front matter", error=PushError)
    if not isinstance(data, dict):
        raise PushError(f"{readme}: front matter is not a YAML mapping")
    return data


def _has_artifact(folder: Path) -> bool:
    for manifest in folder.glob("*/*/manifest.json"):
        try:
            name = read_json(manifest, what="export manifest", error=PushError).get("file")
        except PushError:
            continue
        if isinstance(name, str) and name and (manifest.parent / name).is_file():
            return True
    return False


def upload_files(folder: Path) -> list[tuple[str, int]]:
    """Check ``folder`` is a packaged model and list what an upload sends: (path in repo, bytes), sorted.

    Raises:
        PushError: no folder, no README.md with front matter, or neither config.json nor an artifact.
    """
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder}: no such directory")
    if not (folder / "README.md").is_file():
        raise PushError(f"{folder}: no README.md (write the folder with `moetool package`)")
    _front_matter(folder / "README.md")
    if not (folder / "config.json").is_file() and not is_bundle(folder) and not _has_artifact(folder):
        raise PushError(f"{folder}: neither config.json nor an exported artifact (<target>/<name>/manifest.json)")
    # the same selection upload_folder makes (.git and the huggingface cache stay behind)
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    kept = filter_repo_objects(list(files), ignore_patterns=DEFAULT_IGNORE_PATTERNS)
    return [(rel, files[rel].stat().st_size) for rel in sorted(kept)]


def _scrub(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def _describe(exc: Exception, repo_id: str, where: str) -> str:
    """A one-line reason from an HTTP error, with a hint for the usual causes."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    server = getattr(exc, "server_message", None)
    hints = {
        401: "the token was refused; set HF_TOKEN or run `hf auth login` with a write token",
        403: f"the token may not write to {repo_id}; use a write token for its namespace",
        404: f"{repo_id} or the revision was not found",
        409: "a conflicting operation is in progress; try again",
    }
    reason = f"HTTP {status}" + (f": {server.strip()}" if server else "")
    hint = hints.get(status or 0, "")
    return f"push to {repo_id} at {where} failed: {reason}" + (f" ({hint})" if hint else "")


def _is_network_error(exc: Exception) -> bool:
    # huggingface_hub's HTTP client raises its own transport errors (httpx-style); match them by origin, not by name
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")


def push(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit; return the paths sent.

    Args:
        folder: a folder written by :func:`moetool.package.build_repo`.
        repo_id: ``namespace/name`` (or ``name`` for the token owner's namespace).
        private: create the repository private (an existing one keeps its visibility).
        revision: branch to commit to (created from main when missing); default main.
        commit_message: default "Upload with moetool <version>".
        endpoint: Hub URL; default ``HF_ENDPOINT`` or https://huggingface.co.
        token: default ``HF_TOKEN`` or the saved login, read by huggingface_hub.
        dry_run: only validate and list the files; contact nothing.

    Raises:
        PushError: the folder is not ready, there is no token, or the Hub refused or could not be reached.
    """
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    files = upload_files(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PushError(f"--repo-id {repo_id!r}: {exc}") from None
    paths = [rel for rel, _ in files]
    if dry_run:
        return paths
    secret = token or get_token()
    if not secret:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    where = endpoint or constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=secret)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != constants.DEFAULT_REVISION and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=Path(folder),
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload with moetool {__version__}",
        )
    except HfHubHTTPError as exc:
        raise PushError(_scrub(_describe(exc, repo_id, where), secret)) from None
    except ValueError as exc:  # the Hub's README metadata check, invalid arguments
        raise PushError(_scrub(f"push to {repo_id} at {where} failed: {exc}", secret)) from None
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise PushError(
            _scrub(f"push to {repo_id}: cannot reach {where} ({type(exc).__name__}: {exc})", secret)
        ) from None
    return paths
