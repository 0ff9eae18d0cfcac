"""rayconv.tune's checks before any trial starts (no Ray): the space, the metric, the trial's
placement group, and --gpus-per-actor's settings and memory share."""

from __future__ import annotations

import json

import pytest

from rayconv.config import Config
from rayconv.errors import ConfigError
from rayconv.planner.memory import gpu_share_problem
from rayconv.tune.__main__ import main
from rayconv.tune.runner import check_options
from rayconv.tune.space import check_space, read_space


def test_space_from_json_text_and_file(tmp_path):
    text = '{"lr": {"loguniform": [0.01, 1]}, "opt": {"choice": ["sgd", "sgd_nesterov"]}}'
    (tmp_path / "space.json").write_text(text)
    assert read_space(text) == read_space(str(tmp_path / "space.json"))
    checked = check_space(read_space(text), {"dp": 2})
    assert checked == {"lr": ("loguniform", [0.01, 1.0]), "opt": ("choice", ["sgd", "sgd_nesterov"])}
    assert check_space({"global-batch-size": {"grid": [32, 64]}}, {})["global_batch_size"] == (
        "grid",
        [32, 64],
    )


@pytest.mark.parametrize("space, words", [
    ({"lrr": {"grid": [0.1]}}, "--space lrr: no run flag of that name (did you mean --lr?)"),
    ({"lr": {"normal": [0, 1]}}, "give one of grid, choice, uniform, loguniform, randint"),
    ({"lr": {"uniform": [1, 0.1]}}, "uniform takes low < high"),
    ({"lr": {"loguniform": [0, 1]}}, "loguniform takes low > 0"),
    ({"dp": {"uniform": [1, 4]}}, "--dp takes int: use randint"),
    ({"opt": {"grid": ["sgd", 3]}}, "setting opt = 3 has the wrong type"),
    ({"opt": {"choice": ["sgd", "rmsprop"]}}, "the trial with --opt rmsprop would be refused: unknown --opt"),
    ({"num_microbatches": {"grid": [1, 3]}}, "the trial with --num-microbatches 3 would be refused"),
    ({"out": {"grid": ["a"]}}, "--out is set by the search for each trial"),
    ({"steps": {"randint": [0, 4]}}, "--steps 0 would be refused: --steps must be >= 1"),
])
def test_bad_spaces_get_one_line(space, words):
    with pytest.raises(ConfigError) as e:
        check_space(space, {"dp": 2})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_metric_defaults_and_refusals():
    assert check_options({}, {}, 1, "asha", 2, None, None) == ("test_accuracy", "max")
    assert check_options({}, {}, 1, "fifo", None, "test_loss", None) == ("test_loss", "min")
    for args, words in [
        ((0, "asha", 2, None, None), "--num-samples must be >= 1"),
        ((1, "hyperband", 2, None, None), "--scheduler hyperband: choose asha"),
        ((1, "asha", 0, None, None), "--max-concurrent must be >= 1"),
        ((1, "asha", 2, "val_accuracy", None), "--metric val_accuracy is a validation split's"),
        ((1, "asha", 2, "accuracy", None), "--metric accuracy: choose"),
    ]:
        with pytest.raises(ConfigError, match=words):
            check_options({}, {}, *args)
    with pytest.raises(ConfigError, match="--resume is not for a search's trials"):
        check_options({"resume": "runs/x"}, {}, 1, "asha", None, None, None)


def test_command_line_refuses_in_one_line_exit_2(capsys, tmp_path):
    assert main(["--space", '{"lrr": {"grid": [1]}}', "--dp", "2", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayconv.tune: error: --space lrr") and err.count("\n") == 1
    assert main(["--space", "{not json"]) == 2
    assert "neither a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_trial_bundles_and_gpu_share():
    from rayconv.tune.trial import trial_bundles, trial_index

    cpu = Config(dp=2, fs=2, device="cpu", num_cpus_per_actor=1).validate()
    assert trial_bundles(cpu) == [{}] + [{"CPU": 1}] * 4
    gpu = Config(dp=2, device="cuda", gpus_per_actor=0.25).validate()
    assert trial_bundles(gpu) == [{}, {"CPU": 1, "GPU": 0.25}, {"CPU": 1, "GPU": 0.25}]
    assert trial_index("3f2a1_00007") == 7
    for g, words in [(0, "must be a share of one GPU in (0, 1]"), (1.5, "in (0, 1]")]:
        with pytest.raises(
            ConfigError,
            match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
        ):
            Config(gpus_per_actor=g).validate()
    with pytest.raises(ConfigError, match="drop it with --device cpu"):
        Config(gpus_per_actor=0.5, device="cpu").validate()
    assert gpu_share_problem(30.0, 0.25, 140.0) is None
    problem = gpu_share_problem(40.0, 0.25, 140.0)
    assert "gives each actor 35 GiB" in problem and "at least 0.29" in problem and "\n" not in problem
    assert json.dumps(problem)


def test_pbt_checkpoints_at_each_evaluation_and_perturbs_only_what_a_resume_reads_anew():
    from rayconv.tune.space import pbt_base

    space = check_space({"lr": {"grid": [0.1, 0.2]}, "opt": {"choice": ["sgd", "lars"]}}, {})
    assert pbt_base({"eval_every": 10}, space) == {"eval_every": 10, "checkpoint_every": 10}
    assert pbt_base({"eval_every": 10, "checkpoint_every": 10}, space)["checkpoint_every"] == 10
    for base, sp, words in [({"eval_every": 10}, check_space({"momentum": {"grid": [0.8, 0.9]}}, {}),
                             "search at least one of them"),
                            ({}, space, "give --eval-every N"),
                            ({"eval_every": 10, "checkpoint_every": 5}, space, "drop --checkpoint-every 5")]:
        with pytest.raises(ConfigError, match=words) as e:
            pbt_base(base, sp)
        assert "\n" not in str(e.value)


def test_a_misspelled_search_flag_is_told_the_search_flag(capsys):
    from rayconv.tune.__main__ import main
    assert main(["--space", '{"lr": {"grid": [0.1]}}', "--sheduler", "asha", "--num-sample", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("rayconv.tune: error: unrecognized arguments: --sheduler --num-sample")
        and "\n" not in err
    )
    assert "did you mean --scheduler, --num-samples?" in err
