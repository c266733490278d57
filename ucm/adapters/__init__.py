"""Storage adapters: one medium each, found through `ucm.adapters` entry points."""
from ucm.adapters.base import Status, StorageAdapter, adapter_names, load_adapter_class

__all__ = ["Status", "StorageAdapter", "adapter_names", "load_adapter_class"]
