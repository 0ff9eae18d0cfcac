"""What the tests share besides conftest.py's Ray clusters: ``support.helpers`` (plain-torch reference
SGD runs and state comparisons), ``support.image_folder`` and ``support.shard_folder`` (small real
image and shard folders written to a temporary path), and ``fixtures/`` (users' own model files, given
by path as ``--model FILE:NAME``). Imported as ``support.<module>``: tests/ is on ``sys.path`` because
pytest puts the folder of ``tests/conftest.py`` there (its default ``prepend`` import mode), for a
whole-suite run and a single test file alike."""
