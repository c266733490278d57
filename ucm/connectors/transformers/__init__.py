"""The Hugging Face transformers connector: `generate()` whose prompt prefix
comes from ucm (connector.py), the namespace and payload layout of a model
(namespace.py), the restore of a cached prefix before prefill (restore.py),
the cache layers that grow in place (layers.py), the copies between layers
and payloads (kv_copy.py) and the process-local hbm front before a shared
cache (front.py). Importing this package imports torch and transformers."""
from ucm.connectors.transformers.connector import TransformersConnector, UCMCache
from ucm.connectors.transformers.namespace import BlockLayout, build_namespace

__all__ = ["TransformersConnector", "UCMCache", "BlockLayout", "build_namespace"]
