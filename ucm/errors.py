"""The typed errors of ucm, all under one root.

Misses, "no space" and "still pending" are values (ucm.adapters.base.Status),
never exceptions. These errors are for misuse, bad configuration and broken
invariants; messages carry the actual value and what is allowed.
"""


class UcmError(Exception):
    """Root of every error ucm raises on purpose."""


class ConfigError(UcmError, ValueError):
    """A configuration key is unknown or its value is not allowed."""


class ArgumentError(UcmError, ValueError):
    """A call got an argument it cannot use (wrong size, type, layout)."""


class AdapterNotFoundError(UcmError, LookupError):
    """No adapter is registered under the requested name."""


class PolicyNotFoundError(UcmError, LookupError):
    """No placement policy is registered under the requested name."""


class AdapterError(UcmError):
    """An adapter could not be constructed or used (not a per-block fault)."""


class ClosedError(UcmError):
    """The object was used after close()."""


class CopyAborted(UcmError):
    """Raised by a slot-copy callback that gives up on purpose (its pages were
    taken back): the chunk is aborted like any failed copy, without a
    traceback in the log."""


class TraceError(UcmError, ValueError):
    """A trace file has a malformed line; the message names the line number."""


class ModelError(UcmError):
    """A local model directory cannot be prepared (unknown name, missing package)."""


class TransferParamsWarning(UserWarning):
    """A request's `kv_transfer_params` name blocks this engine cannot use
    (malformed, or another prompt's or namespace's): it is served as a plain
    request, computing what its own cache does not hold."""
