"""fivedc: a declarative compiler from a model graph to a 5-D parallel execution plan."""

__version__ = "0.1.0"

__all__ = ["parallelize"]


def __getattr__(name: str):
    """`fivedc.parallelize` imports torch and the compiler only when first used."""
    if name == "parallelize":
        from fivedc.parallel.parallelize import parallelize

        globals()["parallelize"] = parallelize
        return parallelize
    raise AttributeError(f"module 'fivedc' has no attribute {name!r}")
