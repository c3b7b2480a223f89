"""One type for "a number, or a numpy column of numbers".

The planner's search evaluates a layout rule or a price on every candidate at once, as numpy
columns, with the very code that evaluates it for one plan (ints and floats): the rule or the
price is written once (gptplan.plan.layout, gptplan.money). Such code uses only the operators
both understand (+, *, /, %, comparisons, & and |).
"""

from __future__ import annotations

from typing import Any

# int, float, bool or numpy.ndarray. Any, not their union: numpy's operator overloads turn a
# union into a different union per expression, and callers index the arrays they passed in.
Numbers = Any
