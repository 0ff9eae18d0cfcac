"""The recipe's settings on the driver side, without Ray: every flag's bad values refused in one line
naming it, the learning rate of each step (warm-up, cosine, linear scaling) against
``rayconv.recipe.lr_schedule``, the image size each data set defaults to, and the time-to-accuracy and
metrics bookkeeping."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import ray

from rayconv.bench.__main__ import check as bench_check, parse_args as bench_args
from rayconv.bench.sweeps import target_row
from rayconv.bench.table import BENCH_SCHEMA, bench_table
from rayconv.config import DATA_IMAGE_SIZE, Config, ConfigError
from rayconv.driver.progress import images_line, recipe_line
from rayconv.driver.lr import check_schedule, learning_rate, total_steps, warmup_steps
from rayconv.driver.resolve import resolve_run
from rayconv.driver.target import Target, first_steps_s, train_seconds
from rayconv.flags import from_mapping, parse_args
from rayconv.outputs.metrics import SCHEMA, MetricsLog, reduce_step
from rayconv.recipe import lr_schedule

BAD = [
    (["--opt", "lamb"], "--opt"),
    (["--lr-warmup-epochs", "-1"], "--lr-warmup-epochs"),
    (["--lr-warmup-method", "cosine"], "--lr-warmup-method"),
    (["--lr-warmup-decay", "0"], "--lr-warmup-decay"),
    (["--lr-warmup-decay", "1.5"], "--lr-warmup-decay"),
    (["--lr-warmup-decay", "nan"], "--lr-warmup-decay"),
    (["--lr-scaling", "sqrt"], "--lr-scaling"),
    (["--label-smoothing", "1"], "--label-smoothing"),
    (["--label-smoothing", "-0.1"], "--label-smoothing"),
    (["--norm-weight-decay", "-1e-4"], "--norm-weight-decay"),
    (["--bias-weight-decay", "-1"], "--bias-weight-decay"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm"),
    (["--bn-momentum", "0"], "--bn-momentum"),
    (["--bn-momentum", "1.5"], "--bn-momentum"),
    (["--precise-bn-batches", "-1"], "--precise-bn-batches"),
    (["--model-ema-steps", "0"], "--model-ema-steps"),
    (["--model-ema-decay", "1.01"], "--model-ema-decay"),
    (["--mixup-alpha", "-0.2"], "--mixup-alpha"),
    (["--cutmix-alpha", "-1"], "--cutmix-alpha"),
    (["--random-erase", "1.1"], "--random-erase"),
    (["--augment", "trivial"], "--augment"),
    (["--channels", "2"], "--channels"),
    (["--target-accuracy", "0"], "--target-accuracy"),
    (["--target-accuracy", "1.2"], "--target-accuracy"),
    (["--precision", "fp8"], "--precision"),
    (["--image-size", "0"], "--image-size"),
    (["--cuda-graphs", "on", "--opt", "adamw"], "--cuda-graphs on"),
    (["--cuda-graphs", "on", "--precision", "fp16"], "--cuda-graphs on"),
]


@pytest.mark.parametrize("argv, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_recipe_values_are_refused_in_one_line_naming_the_flag(argv, flag, capsys):
    """A bad value is a ConfigError (validation) or argparse's exit 2 (a choice), one line either way."""
    try:
        parse_args(argv)
    except ConfigError as e:
        message = str(e)
    except SystemExit as e:
        assert e.code == 2
        message = capsys.readouterr().err.strip()
    else:
        pytest.fail(f"{argv} was accepted")
    assert flag in message and "\n" not in message


@pytest.mark.parametrize("field, value, flag", [("opt", "lamb", "--opt"), ("augment", "x", "--augment"),
                                                ("lr_scaling", "log", "--lr-scaling"),
                                                ("precision", "fp8", "--precision"),
                                                ("lr_warmup_method", "exp", "--lr-warmup-method")])
def test_bad_choices_from_python_or_json_are_refused_by_validate(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        Config(**{field: value}).validate()


def test_recipe_flags_parse_and_round_trip_through_config_json(tmp_path):
    argv = ["--opt", "sgd_nesterov", "--lr", "0.5", "--lr-scaling", "linear", "--lr-warmup-epochs", "5",
            "--lr-warmup-method", "constant", "--lr-warmup-decay", "0.1", "--label-smoothing", "0.1",
            "--norm-weight-decay", "0", "--bias-weight-decay", "0", "--clip-grad-norm", "1", "--model-ema",
            "--model-ema-steps", "4", "--model-ema-decay", "0.999", "--zero-init-residual", "--mixup-alpha",
            "0.2", "--cutmix-alpha", "1", "--random-erase", "0.25", "--augment", "resized-crop", "--channels",
            "3", "--target-accuracy", "0.9", "--precision", "fp16", "--image-size", "16", "--bn-momentum",
            "0.01", "--data", "fashion-mnist", "--precise-bn-batches", "20"]
    cfg = parse_args(argv)
    assert (cfg.opt, cfg.lr_scaling, cfg.lr_warmup_epochs, cfg.lr_warmup_method) == ("sgd_nesterov", "linear",
                                                                                     5, "constant")
    assert (cfg.norm_weight_decay, cfg.bias_weight_decay, cfg.clip_grad_norm) == (0.0, 0.0, 1.0)
    assert cfg.model_ema and cfg.zero_init_residual and cfg.model_ema_steps == 4 and cfg.channels == 3
    assert cfg.bn_momentum == 0.01 and parse_args([]).bn_momentum is None
    assert cfg.precise_bn_batches == 20 and parse_args([]).precise_bn_batches == 0
    assert (cfg.precision, cfg.image_size, cfg.target_accuracy, cfg.augmentation) == ("fp16", 16, 0.9,
                                                                                      "resized-crop")
    cfg.to_json(tmp_path / "config.json")
    assert from_mapping(json.loads((tmp_path / "config.json").read_text())) == cfg
    defaults = parse_args([])
    assert (defaults.opt, defaults.lr_warmup_epochs, defaults.label_smoothing, defaults.model_ema_decay) == \
        ("sgd", 0, 0.0, 0.99998)
    assert defaults.norm_weight_decay is None and defaults.image_size is None and not defaults.model_ema
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.opt = "adamw"  # type: ignore[misc]


def test_image_size_defaults_to_the_datas_own_and_augment_auto_follows_it():
    assert {d: Config(data=d, data_dir="x").data_image_size for d in DATA_IMAGE_SIZE} == \
        {"digits": 8, "fashion-mnist": 28, "synthetic": 224, "imagefolder": 224, "shards": 224}
    assert Config(data="synthetic", image_size=32).data_image_size == 32
    assert Config(data="fashion-mnist").augmentation == "pad-crop"
    assert Config(data="synthetic", image_size=64).augmentation == "pad-crop"
    assert Config(data="synthetic", image_size=65).augmentation == "resized-crop"
    assert Config(data="synthetic").augmentation == "resized-crop"
    assert Config(data="synthetic", augment="none").augmentation == "none"
    assert Config(image_size=8).validate().image_size == 8  # below 32: each model refuses its own


# ---------------------------------------------------------------------- learning rate
def test_without_warmup_the_lr_is_the_plain_cosine_and_constant():
    cfg = Config(lr=0.05)
    for step in range(0, 100, 7):
        assert learning_rate(cfg, step, 100) == pytest.approx(
            0.05 * 0.5 * (1 + math.cos(math.pi * step / 100))
        )
    assert learning_rate(Config(lr=0.3, lr_schedule="constant"), 42, 100) == 0.3


@pytest.mark.parametrize("method", ["linear", "constant"])
@pytest.mark.parametrize("sched", ["cosine", "constant"])
def test_warmup_epochs_become_steps_and_follow_recipe_schedule(method, sched):
    spe, epochs, warm = 23, 10, 3
    cfg = Config(lr=0.2, epochs=epochs, lr_warmup_epochs=warm, lr_warmup_method=method, lr_warmup_decay=0.05,
                 lr_schedule=sched).validate()
    total = total_steps(cfg, spe)
    assert total == 230 and warmup_steps(cfg, spe) == warm * spe
    got = [learning_rate(cfg, s, total, spe) for s in range(total)]
    want = [lr_schedule.schedule_lr(s, total, 0.2, warm * spe, 0.05, sched, method) for s in range(total)]
    assert got == want
    assert got[0] == pytest.approx(0.2 * 0.05) and got[warm * spe] == pytest.approx(0.2)
    if method == "linear":
        assert all(a < b for a, b in zip(got[:warm * spe], got[1:warm * spe + 1]))  # rising every step


def test_linear_scaling_multiplies_lr_by_global_batch_over_256():
    cfg = Config(lr=0.1, lr_scaling="linear", global_batch_size=1024, lr_schedule="constant")
    assert learning_rate(cfg, 5, 10) == pytest.approx(0.4)
    cfg = dataclasses.replace(cfg, lr_schedule="cosine", lr_warmup_epochs=1)
    assert learning_rate(cfg, 0, 100, 10) == pytest.approx(0.4 * 0.01)
    assert learning_rate(cfg, 10, 100, 10) == pytest.approx(0.4)


def test_a_warmup_longer_than_the_run_is_refused_naming_the_flag():
    check_schedule(Config(steps=30, lr_warmup_epochs=3), steps_per_epoch=10)  # equal: fine
    with pytest.raises(ConfigError, match="--lr-warmup-epochs 4 is 40 steps"):
        check_schedule(Config(steps=30, lr_warmup_epochs=4), steps_per_epoch=10)


@pytest.mark.parametrize("bad", [dict(label_smoothing=1.0), dict(opt="lamb"), dict(lr_warmup_decay=0.0),
                                 dict(target_accuracy=0.0), dict(channels=4)])
def test_fit_from_python_validates_before_ray_starts(bad):
    if ray.is_initialized():  # (an earlier module's shared cluster: this test needs none connected)
        ray.shutdown()
    with pytest.raises(ConfigError):
        resolve_run(Config(**bad), log=lambda *_: None)
    assert not ray.is_initialized()


# ---------------------------------------------------------------------- time to accuracy, metrics
def test_target_records_the_first_evaluation_that_reaches_it():
    wall = {0: (64, 5.0), 1: (64, 2.0), 2: (64, 0.5), 3: (64, 0.5), 4: (64, 0.5)}
    assert train_seconds(wall, 2) == 7.5 and first_steps_s(wall) == 7.0 and first_steps_s({}) is None
    t = Target(0.9)
    assert not t.update(1, 0.85, 10.0, train_seconds(wall, 1))
    assert t.update(3, 0.9, 20.0, train_seconds(wall, 3), 26.5)  # >= counts
    assert not t.update(4, 0.95, 30.0, train_seconds(wall, 4), 36.5)  # only the first
    assert t.summary(wall) == {"target_accuracy": 0.9, "target_step": 3, "time_to_target_s": 20.0,
                               "time_to_target_train_s": 8.0, "time_to_target_since_s": 26.5,
                               "first_steps_s": 7.0}
    never, none = Target(0.99), Target(None)
    never.update(4, 0.95, 30.0, 9.0)
    none.update(4, 1.0, 30.0, 9.0)
    for s in (never.summary(wall), none.summary(wall)):
        assert (
            s["time_to_target_s"] is None and s["time_to_target_train_s"] is None and s["target_step"] is None
        )


def test_metrics_rows_carry_loss_scale_and_ema_accuracy():
    base = dict(reports=True, samples=4, loss_sum=2.0, correct=1)
    assert reduce_step([base, {**base, "reports": False}])["loss_scale"] is None
    assert reduce_step([{**base, "loss_scale": 1024.0},
                        {**base, "loss_scale": 1024.0}])["loss_scale"] == 1024.0
    assert {"loss_scale", "ema_test_accuracy"} <= set(SCHEMA.names)
    log = MetricsLog()
    log.add(kind="train", step=0, loss=1.0, loss_scale=65536.0)
    log.add(kind="eval", step=0, test_accuracy=0.5, ema_test_accuracy=0.4)
    table = log.table().to_pylist()
    assert table[0]["loss_scale"] == 65536.0 and table[1]["loss_scale"] is None
    assert table[1]["ema_test_accuracy"] == 0.4


def test_bench_target_rows_fit_its_schema_and_need_curve():
    summary = {"time_to_target_s": None, "time_to_target_train_s": None, "first_steps_s": 0.7,
               "target_accuracy": 0.99, "test_accuracy": 0.9, "images_per_s": 100.0, "steps": 50,
               "layout": {"world_size": 2}}
    row = target_row("dp2", Config(target_accuracy=0.99, dp=2), summary)
    assert "never reached 0.99" in row["note"] and row["image_size"] == 8
    assert bench_table([row]).num_rows == 1 and "time_to_target_s" in BENCH_SCHEMA.names
    with pytest.raises(ConfigError, match="--curve"):
        bench_check(bench_args(["--target-accuracy", "0.9"]))
    with pytest.raises(ConfigError, match="--target-accuracy"):
        bench_check(bench_args(["--curve", "--target-accuracy", "2"]))


def test_header_names_images_augmentation_and_recipe():
    cfg = Config(data="fashion-mnist", channels=3, lr=0.1, lr_scaling="linear", global_batch_size=512,
                 lr_warmup_epochs=2, label_smoothing=0.1, norm_weight_decay=0.0, model_ema=True)
    resolved = SimpleNamespace(cfg=cfg, source=SimpleNamespace(sample_shape=(1, 28, 28)),
                            sharding=SimpleNamespace(steps_per_epoch=117))
    line = images_line(resolved)
    assert "3 x 28 x 28" in line and "1 channel" in line and "--augment auto (pad-crop)" in line
    told = SimpleNamespace(cfg=cfg,
                           source=SimpleNamespace(sample_shape=(1, 28, 28), augmentation="pad-crop-flip"))
    assert "augmentation pad-crop-flip" in images_line(told)
    recipe = recipe_line(resolved)
    assert "lr 0.2" in recipe and "234 warm-up steps" in recipe and "label smoothing 0.1" in recipe
    assert "norms 0" in recipe and "EMA every 32 steps" in recipe
