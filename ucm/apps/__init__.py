"""Applications built on the library: the demo (`make demo`), the vLLM
benchmark (`ucm bench vllm`) and model preparation (`ucm model prepare`).

Engines (vLLM, SGLang, transformers) are imported only here and in
ucm/connectors/, lazily; the library below them (cache, placement, tiers,
service, adapters; torch only for the hbm device pool) never imports one
(tests/unit/test_layering.py checks it).
"""
