from sgl_jax.version import __version__  # noqa: F401
