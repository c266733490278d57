"""The service process (`ucm serve`): the event loop (loop.py), the
operations it answers (handlers.py), metrics (metrics.py) and the process
around them (serve.py)."""
