"""User-facing errors: one line that names the file, tensor or flag and what was expected."""


class HybridError(Exception):
    """An error caused by the user's input (files, flags, requests), not by a bug.

    Console scripts print `error: <message>` and exit non-zero, without a traceback
    unless `--debug` is given.
    """


class CheckpointError(HybridError):
    """A model folder or safetensors file is missing, corrupt, or not what its config says."""


class PlanError(HybridError):
    """A placement plan does not fit the hardware."""
