"""Errors by kind: what a user can cause is a ``UserError``; anything else is a bug and keeps its traceback.

``lightning-spec`` (``cli.main``) prints a ``UserError`` as its one sentence, ``lightning-spec: error: ...``, and
exits with status 2; every other exception propagates with its traceback (``LIGHTNING_SPEC_TRACEBACK=1`` shows the
traceback of a user error too). A ``ValueError`` raised for an invariant of the package's own making (shapes it
produced that disagree, a helper called out of order) stays a plain ``ValueError``: it is a bug to report, not a
setting to change.
"""

from __future__ import annotations


class UserError(ValueError):
    """What a user can cause (a bad option or field value, a missing or wrong file, data that does not fit the
    run); ``lightning-spec`` prints it as its one sentence, without a traceback.

    The message names what to change (the option, field, file or data) and how. A ``ValueError`` on purpose: the
    checks it replaced raised ``ValueError``, and every ``except ValueError`` (jsonargparse's type checks among
    them) and ``pytest.raises(ValueError, match=...)`` still catches it."""


class DivergedLoss(UserError, FloatingPointError):
    """The training loss is not finite: the run diverged (too high a learning rate, broken examples). A
    ``FloatingPointError`` as well, so what caught the module's ``FloatingPointError`` still does."""

    @classmethod
    def at(cls, loss: float, step: int, lr: float) -> DivergedLoss:
        """The sentence for a non-finite ``loss`` at optimizer ``step`` under learning rate ``lr``."""
        return cls(f"train/loss is not finite ({loss}) at step {step}: training diverged; lower model.lr (the learning "
                   f"rate is {lr:g}) or check the data for broken examples.")
