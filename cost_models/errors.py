"""The one exception the cost models raise.

A ValueError subclass, so callers that already catch ValueError for bad
user input (a mistyped hardware name, "70GiBs") keep working; autopar wraps
it into its own AutoparError where it needs a node or module path.
"""


class CostModelError(ValueError):
    pass
