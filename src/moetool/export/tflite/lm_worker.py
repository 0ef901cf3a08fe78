"""A ``.litertlm`` bundle generating in Google's LiteRT-LM runtime (litert-lm-api), where it is installed (beside
litert-torch, :mod:`moetool.export.tflite.runner`):

    python -m moetool.export.tflite.lm_worker REQUEST.json

REQUEST has bundle (the ``.litertlm``), prompt, max_new (tokens to decode) and capacity (the model's cache slots).
The engine runs on the CPU with float32 activations (its default for a text decoder is fp16, which would not compute
what the exported model does) and greedy sampling (top_k 1), the prompt fed as is (no chat template). Prints text,
prompt_tokens, new_tokens, prefill_tok_s, decode_tok_s and ttft_s as JSON on the last line.
"""

from __future__ import annotations

import tempfile
from typing import Any


def generate(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, the text and the engine's own timings out."""
    import litert_lm

    # the engine writes its XNNPACK weight cache beside the bundle unless told where: into a folder that goes with
    # this run, so the output folder holds only what moetool wrote
    with tempfile.TemporaryDirectory(prefix="litert-lm-cache-") as cache:
        engine = litert_lm.Engine(
            str(req["bundle"]),
            backend=litert_lm.Backend.CPU(thread_count=2),
            max_num_tokens=int(req["capacity"]),
            activation_data_type=litert_lm.ActivationDataType.FLOAT32,
            enable_benchmark=True,
            cache_dir=cache,
        )
        session = engine.create_session(
            apply_prompt_template=False,
            max_output_tokens=int(req["max_new"]),
            sampler_config=litert_lm.SamplerConfig(top_k=1),
        )
        session.run_prefill([str(req["prompt"])])
        text = session.run_decode().texts[0]
        info = session.get_benchmark_info()
        session.close()
        engine.close()
    return {
        "text": text,
        "prompt_tokens": int(info.last_prefill_token_count),
        "new_tokens": int(info.last_decode_token_count),
        "prefill_tok_s": round(float(info.last_prefill_tokens_per_second), 1),
        "decode_tok_s": round(float(info.last_decode_tokens_per_second), 1),
        "ttft_s": round(float(info.time_to_first_token_in_second), 4),
    }


if __name__ == "__main__":
    from moetool.export.worker import worker_main

    worker_main(generate)
