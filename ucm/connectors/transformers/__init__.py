"""The Hugging Face transformers connector: `generate()` whose prompt prefix
comes from ucm (connector.py), the cache of one request (request_cache.py)
and its rows (prompt_rows.py), the namespace and payload layout of a model
(namespace.py), the restore of a cached prefix before prefill (restore.py),
the calls into a cache where a fault is a miss (guard.py), the cache layers
that grow in place (layers.py), the copies between layers and payloads
(kv_copy.py), the process-local hbm front before a shared cache
(front.py) and passages reused anywhere in a prompt (blend.py).
Importing this package imports torch and transformers."""
from ucm.connectors.transformers.blend import BlendReport, ChunkBlender
from ucm.connectors.transformers.connector import TransformersConnector
from ucm.connectors.transformers.namespace import BlockLayout, build_namespace
from ucm.connectors.transformers.request_cache import UCMCache

__all__ = ["TransformersConnector", "UCMCache", "BlockLayout", "build_namespace", "ChunkBlender", "BlendReport"]
