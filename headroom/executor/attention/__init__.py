from headroom.executor.attention.backend import AttentionBackend, available_backends, select_backend
from headroom.executor.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "select_backend"]
