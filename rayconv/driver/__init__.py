"""The driver: one training job from its settings to ``model.pt``.

``job`` is the outline (``train_run``: resolve -> start the actors -> the step loop -> finish, with recovery);
``early`` starts the actors before the driver imports torch (``prestart``: the output folder and the run's
name, without torch) and says when they may start while it checks; ``resolve`` checks and
resolves the run before any actor's setup; ``loop`` runs the steps; ``progress`` prints; ``finish`` writes
the results.
Nothing is imported here: ``driver.early`` and ``driver.prestart`` must stay free of torch."""
