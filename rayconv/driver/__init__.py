"""The driver: one training job from its settings to ``model.pt``.

``job`` is the outline (``train_run``: resolve -> start the actors -> the step loop -> finish, with recovery);
``resolve`` checks and resolves the run before any actor starts; ``loop`` runs the steps; ``progress``
prints; ``finish`` writes the results."""

from rayconv.driver.job import train_run

__all__ = ["fit"]
