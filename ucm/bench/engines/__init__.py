"""Benches that run a real engine (`ucm bench vllm|transformers|sglang|prefetch|codec|sparse|pages|gpu-ttft`).
Engines are imported here and in ucm/connectors/ only, lazily."""
