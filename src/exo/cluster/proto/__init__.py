"""Generated gRPC modules of the cluster transport (from proto/exo/cluster.proto).

Do not edit: regenerate with `uv run python -m exo.cluster.codegen`.
"""
