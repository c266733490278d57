"""The demo of `make demo`: vLLM for CPU serving interleaved documents and
chats alone, with ucm, and restarted with ucm (run.py); the workload
(workload.py), the engine runs (engine.py) and the report (report.py)."""
