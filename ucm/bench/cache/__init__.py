"""Benches of the cache itself (`ucm bench io|placement|service|soak|trace|tracegen`)."""
