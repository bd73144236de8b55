"""Which MLX backend runs here by default.

Imports only `mlx.core`, so a child process can ask it cheaply: the node
process itself never imports MLX (see `exo.worker.telemetry`)."""

import mlx.core as mx

from exo.shared.types.state import MlxBackend


def backend_name() -> MlxBackend:
    """`metal`, `cuda` or `cpu`: where MLX runs by default here."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"
