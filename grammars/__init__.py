"""The DSL grammar, shipped as package data of `fivedc.grammars`."""
