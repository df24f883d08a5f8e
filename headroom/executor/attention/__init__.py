from headroom.executor.attention.backend import available_backends, select_backend

__all__ = ["available_backends", "select_backend"]
