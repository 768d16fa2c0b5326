"""``trtvocab generate``: a causal LM's decode loop with the vocabulary dimension split over ``tp`` ranks.

The body (attention, MLPs, the final norm) runs whole in ``transformers`` with its KV cache (``attention_dp``:
each rank its own block of prompts); the vocabulary ends (:class:`~trtvocab.pipeline.decode.VocabEnds`: the
embedding, the head and the gather-free sampler) run in trtvocab. In the order a run goes through it:

- :mod:`.options`: :class:`GenerateOptions`, what a run asks for, checked when made (errors name the
  field; the command line spells each as its flag), and :class:`GenerateSpec`, what it resolves to;
- :mod:`.model`: the model and tokenizer, loaded once per process, and the body with its KV cache;
- :mod:`.prepare`: options -> spec (the artifact checked, the ranks chosen, the model loaded);
- :mod:`.loop` (and :mod:`.beams`): one rank's batching loop, its state passed explicitly, batched as
  ``transformers.generate`` batches (left padding); ``tp > 1`` runs on gloo ranks;
- :mod:`.report`: what a run returns. See docs/generate.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trtvocab.pipeline.generate.loop import SETUP_HANDSHAKE, generate
from trtvocab.pipeline.generate.model import LoadedModel, encode_prompts, load_model, model_path, words_token_ids
from trtvocab.pipeline.generate.options import (
    KV_CACHES,
    ArtifactSpec,
    GenerateOptions,
    GenerateSpec,
    check_options,
    choose_body_ranks,
    lora_plan,
    parse_logit_bias,
    prompt_block,
    rank_blocks,
    sampling_params,
)
from trtvocab.pipeline.generate.prepare import artifact_spec, prepare
from trtvocab.pipeline.generate.report import GenerateReport, GenerateResult, cut_at_stop


def run(model: str | Path, prompts: list[str], **options: Any) -> GenerateReport:
    """:func:`prepare` then :func:`generate`: the Python twin of ``trtvocab generate``."""
    spec, loaded = prepare(model, prompts, **options)
    return generate(spec, loaded)


__all__ = ["KV_CACHES", "SETUP_HANDSHAKE", "ArtifactSpec", "GenerateOptions", "GenerateReport", "GenerateResult",
           "GenerateSpec", "LoadedModel", "artifact_spec", "check_options", "choose_body_ranks", "cut_at_stop",
           "encode_prompts", "generate", "load_model", "lora_plan", "model_path", "parse_logit_bias", "prepare",
           "prompt_block", "rank_blocks", "run", "sampling_params", "words_token_ids"]
