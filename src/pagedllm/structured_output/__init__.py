"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF).

`params` is plain data that SamplingParams carries; `backend` (xgrammar) and `manager`
(per-sequence matchers, the batch's token bitmask) are imported only when a request asks
for a constraint, so an unconstrained engine never loads the grammar engine.
"""

from pagedllm.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
