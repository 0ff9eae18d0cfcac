"""The driver: one training job from its settings to ``model.pt``.

``job`` is the outline (``fit``: setup -> start the actors -> the step loop -> finish, with recovery);
``setup`` checks and resolves the run before any actor starts; ``loop`` runs the steps; ``progress``
prints; ``finish`` writes the results."""

from rayconv.driver.job import fit

__all__ = ["fit"]
