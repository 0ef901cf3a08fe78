"""Ship a model: lay out a Hugging Face repo folder (weights, artifacts, evaluation, card) and upload it."""

from moetool.package.build import PackageError, build_repo
from moetool.package.hub import PushError, push, upload_files

__all__ = ["PackageError", "PushError", "build_repo", "push", "upload_files"]
