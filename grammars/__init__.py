"""The grammars of fivedc's text formats (package data: `fivedc.lark`, the `.5d` model DSL)."""
