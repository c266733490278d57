"""Applications built on the library: the demo (`make demo`), model
preparation (`ucm model prepare`) and the engine subprocesses' environment
the demo and the vLLM benches share (engine_env.py).

Engines (vLLM, SGLang, transformers) are imported only here, in
ucm/bench/engines/ and in ucm/connectors/, lazily; the library below them (cache, placement, tiers,
service, adapters; torch only for the hbm device pool) never imports one
(tests/unit/test_layering.py checks it).
"""
