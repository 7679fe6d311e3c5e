"""The build-along's former name, kept so that copies of exercise 07 handed out before the package was
renamed (their locked cell imports `Learner, Pieces, Unit` from here) still run: `labkit.buildalong` is it."""

from labkit.buildalong import Learner, Pieces, Unit, attach

__all__ = ["Learner", "Pieces", "Unit", "attach"]
