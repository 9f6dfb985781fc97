"""fivedc: a declarative compiler from a model graph to a 5-D parallel execution plan."""

__version__ = "0.1.0"

__all__ = ["parallelize", "empty_weights"]


def __getattr__(name: str):
    """`fivedc.parallelize` (and `fivedc.empty_weights`) import torch and the compiler only when first used."""
    if name == "parallelize":
        from fivedc.parallel.parallelize import parallelize

        globals()["parallelize"] = parallelize
        return parallelize
    if name == "empty_weights":
        from fivedc.frontends.weightless import empty_weights

        globals()["empty_weights"] = empty_weights
        return empty_weights
    raise AttributeError(f"module 'fivedc' has no attribute {name!r}")
