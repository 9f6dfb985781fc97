"""fivedc: a declarative compiler from a model graph to a 5-D parallel execution plan."""

__version__ = "0.1.0"
