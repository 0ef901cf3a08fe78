"""One Core ML package from a chunk of decoder layers, converted in a process of its own so that nothing coremltools
or the trace leaves allocated outlives it (:data:`moetool.export.coreml.exporter.IN_CHILD`):

    python -m moetool.export.coreml.worker REQUEST.json

REQUEST has ``model_dir``, ``layers`` ``[start, stop)``, ``first`` and ``last`` (whether the chunk embeds the tokens
and computes the logits), ``precisions`` (export name → fp32|int8|int4), ``capacity`` (the cache's positions),
``units`` (the compute units) and ``path`` (the package to write). Prints ``compressed`` (weight → what it became)
and ``structure`` (:func:`moetool.export.coreml.package.structure`).
"""

from __future__ import annotations

if __name__ == "__main__":
    from moetool.export.coreml.exporter import converted_in_child
    from moetool.export.worker import worker_main

    worker_main(converted_in_child)
