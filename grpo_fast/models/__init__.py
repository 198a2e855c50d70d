"""Models: loading them (the default SmolLM2 from its registry package, local folders) and the
adapter that splits a causal LM into the decoder and the lm_head the fused ops take.

Light to import: transformers loads on the first model load.
"""

from .adapter import (
    LOGIT_TRANSFORM_FIELDS,
    causal_lm_of,
    check_fusable,
    decoder_of,
    logit_transform,
    output_head,
)
from .loading import DEFAULT_MODEL, cache_dir, check_model_folder, default_model_path, load_policy, resolve_model_path

__all__ = [
    "DEFAULT_MODEL",
    "LOGIT_TRANSFORM_FIELDS",
    "cache_dir",
    "causal_lm_of",
    "check_fusable",
    "check_model_folder",
    "decoder_of",
    "default_model_path",
    "load_policy",
    "logit_transform",
    "output_head",
    "resolve_model_path",
]
