"""NVIDIA Dynamo integration: `worker.py` is a thin Dynamo worker (run with
the Dynamo venv's python, not imported from ucm) that puts a vLLM
OpenAI-compatible server behind Dynamo's KV router."""
