"""The one error hierarchy: every error specjax raises for a problem the user can fix derives from `SpecjaxError`,
and also from the builtin it is (ValueError for bad input, RuntimeError for an environment that cannot run the
request), so `except specjax.SpecjaxError` catches them all and existing `except ValueError` clauses keep working.

This module imports nothing: it sits below every other module, the remapped `specjax.kernels` and
`specjax.backends` folders included.
"""


class SpecjaxError(Exception):
    """Base of every specjax error; its message names the problem and how to fix it."""


class TokenizerError(SpecjaxError, ValueError):
    """A tokenizer could not be built or used (its files are malformed, or a chat template failed or ran past its
    limits); the message names the problem and the fix. Re-exported by `specjax.models.tokenizer`."""


class NonFiniteLogitsWarning(UserWarning):
    """The target produced NaN or infinite logits for a request (a corrupt checkpoint, or an overflow in a low
    precision dtype): that request stopped with finish_reason "error" without sampling from them; the other
    requests of the batch are unaffected."""
