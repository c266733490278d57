"""The tiers as one ordered stack: stack.py runs plans against the adapters
(per-key order in key_order.py), executor.py admits placement's plans to it
and reconciles what happened."""
