"""Exception hierarchy: every error a user can cause says what is wrong and where."""

from __future__ import annotations

import warnings


class MoetoolError(Exception):
    """Base class for errors caused by input, not by bugs."""


class RecipeError(MoetoolError):
    """A recipe file is malformed or invalid."""


class SourceError(MoetoolError):
    """A model source cannot be resolved or read."""


class PreflightError(MoetoolError):
    """Experts cannot be merged; raised before anything is written."""


class UnsupportedArchitecture(PreflightError):
    """No output architecture accepts the inputs."""


class OutputExistsError(MoetoolError):
    """The output exists and ``--force`` was not given."""


class CheckpointError(SourceError):
    """A checkpoint file (safetensors header, index, config, tokenizer file) is corrupt or incomplete; names the file."""


class InputFileError(MoetoolError):
    """A file moetool reads (JSON, YAML) is unreadable, too large, not UTF-8 or malformed; names the file."""


class OutputPathError(MoetoolError):
    """The output path cannot be written safely (a file as parent, no write permission, inside an input, …)."""


class MoetoolDeprecationWarning(FutureWarning):
    """An old spelling moetool still reads for one release (a renamed option or recipe key); the message names the
    new spelling. The CLI prints it as one ``deprecated:`` line."""


def deprecated(message: str) -> None:
    """Warn that an old spelling was read: ``message`` names the new one (and that the old goes in a release)."""
    warnings.warn(message, MoetoolDeprecationWarning, stacklevel=3)
