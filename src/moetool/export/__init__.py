"""Exporters: one artifact per target, each verified in its own runtime, with a manifest."""

from moetool.export.base import TARGETS, ExportError, ExportRequest, get_exporter, read_manifest

__all__ = ["TARGETS", "ExportError", "ExportRequest", "get_exporter", "read_manifest"]
