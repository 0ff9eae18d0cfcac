"""Settings from flags and config files (rayconv.flags.parse_args over rayconv.config.Config): defaults,
overrides, types, and each refusal naming the flag to change."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rayconv.config import Config, ConfigError
from rayconv.flags import parse_args


def test_no_flags_gives_the_defaults():
    assert parse_args([]) == Config()


def test_flags_set_fields():
    cfg = parse_args(["--model", "alexnet", "--data", "synthetic", "--dp", "2", "--pp", "3", "--fs", "2",
                      "--global-batch-size", "128", "--lr", "0.1", "--steps", "7", "--precision", "bf16",
                      "--no-progress", "--sync-batchnorm", "--stages", "5,9", "--out", "somewhere"])
    assert (cfg.model, cfg.data, cfg.dp, cfg.pp, cfg.fs) == ("alexnet", "synthetic", 2, 3, 2)
    assert cfg.global_batch_size == 128 and isinstance(cfg.global_batch_size, int)
    assert cfg.lr == 0.1 and isinstance(cfg.lr, float)
    assert (cfg.steps, cfg.precision, cfg.stages, cfg.out) == (7, "bf16", "5,9", "somewhere")
    assert cfg.progress is False and cfg.sync_batchnorm is True
    # Untouched fields keep their defaults.
    assert cfg.momentum == Config().momentum and cfg.seed == Config().seed


def test_bad_flag_type_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--dp", "two"])
    assert e.value.code == 2
    assert "--dp" in capsys.readouterr().err


def test_config_file_with_flags_overriding(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "resnet18", "data": "synthetic", "lr": 0.2, "dp": 4, "steps": 3}))
    cfg = parse_args(["--config", str(path), "--lr", "0.01", "--steps", "9"])
    assert (cfg.model, cfg.data, cfg.dp) == ("resnet18", "synthetic", 4)   # from the file
    assert (cfg.lr, cfg.steps) == (0.01, 9)                                 # flags win
    assert cfg.global_batch_size == Config().global_batch_size             # neither: default


def test_written_config_reads_back(tmp_path):
    cfg = Config(model="vgg11", data="synthetic", dp=3, image_size=64, steps=11, progress=False,
                 out=str(tmp_path / "x")).validate()
    cfg.to_json(tmp_path / "config.json")
    # Everything but the output folder (a re-run writes to a new one unless --out says).
    assert parse_args(["--config", str(tmp_path / "config.json")]) == dataclasses.replace(cfg, out=None)


def test_unknown_key_in_config_file_is_rejected(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "convnet", "learning_rate": 0.1}))
    with pytest.raises(ConfigError, match="learning_rate"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("content, match", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_malformed_config_file(tmp_path, content, match):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        parse_args(["--config", str(path)])
    assert "--config" in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--config .*no such file"):
        parse_args(["--config", str(tmp_path / "nope.json")])


def test_exchange_chunks_without_filter_split_are_refused():
    with pytest.raises(ConfigError,
                       match="--exchange-chunks 4 applies to filter split's gathers: add --fs 2"):
        parse_args(["--exchange-chunks", "4"])
    assert parse_args(["--exchange-chunks", "4", "--fs", "2"]).exchange_chunks == 4


def test_bad_value_in_config_file_names_the_flag(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"pp": 0}))
    with pytest.raises(ConfigError, match="--pp"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("argv, match", [
    (["--dp", "1", "--pp", "2", "--global-batch-size", "64", "--num-microbatches", "5"],
     r"--num-microbatches 5 does not divide the per-replica batch 64 \(= --global-batch-size 64 / dp 1\)"),
    (["--dp", "2", "--pp", "2", "--global-batch-size", "8", "--num-microbatches", "8"],
     "--num-microbatches 8 exceeds the per-replica batch 4"),
])
def test_microbatches_that_do_not_split_the_batch_are_refused_before_ray_starts(argv, match):
    """Checked with the settings (parse_args validates), not after Ray has started; with --dp left to the
    cluster the plan checks it once dp is known (same message)."""
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)
    assert parse_args(argv[:-1] + ["4"]).num_microbatches == 4


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--virtual-stages", "2"], "set --pp 2 or more"),
        (["--pp", "2", "--virtual-stages", "2", "--schedule", "gpipe"], "use --schedule 1f1b, not gpipe"),
        (
            ["--pp", "2", "--fs", "2", "--virtual-stages", "2", "--num-microbatches", "2"],
            "does not combine with --fs",
        ),
        (
            ["--pp", "2", "--virtual-stages", "2", "--num-microbatches", "3", "--global-batch-size", "96"],
            r"set --num-microbatches to a multiple of 2 \(got 3\)",
        ),
        (["--pp", "2", "--virtual-stages", "0"], "--virtual-stages must be >= 1"),
    ],
)
def test_bad_virtual_stages_are_refused_with_what_to_change(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


@pytest.mark.parametrize("argv, flag", [
    (["--pp", "0"], "--pp"),
    (["--fs", "0"], "--fs"),
    (["--dp", "0"], "--dp"),
    (["--steps", "0"], "--steps"),
    (["--epochs", "-1"], "--epochs"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--num-microbatches", "0"], "--num-microbatches"),
    (["--num-classes", "0"], "--num-classes"),
    (["--eval-every", "0"], "--eval-every"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "1.0"], "--momentum"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--image-size", "0"], "--image-size"),  # (below 32 is each model's to refuse: build_model)
    (["--loader-workers", "-1"], "--loader-workers"),
    (["--collective-timeout-s", "0"], "--collective-timeout-s"),
    (["--data", "imagefolder"], "--data-dir"),
    (["--plan", "krizhevsky2014", "--pp", "2"], "--pp"),
])
def test_validation_error_names_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert flag in str(e.value)


def test_config_file_types_are_checked(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"dp": "2"}))
    with pytest.raises(ConfigError, match="dp = '2' has the wrong type: --dp takes int"):
        parse_args(["--config", str(path)])
    path.write_text(json.dumps({"stages": [5, 9]}))
    with pytest.raises(ConfigError, match="--stages takes str"):
        parse_args(["--config", str(path)])
    path.write_text(json.dumps({"lr": 1, "progress": False, "dp": None}))   # an int is a fine float
    assert parse_args(["--config", str(path)]).lr == 1


def test_config_file_of_a_resumed_run_starts_a_new_run(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"steps": 4, "out": "runs/r1", "resume": "runs/r1",
                                "address": "10.0.0.5:6379"}))
    cfg = parse_args(["--config", str(path)])
    assert (cfg.steps, cfg.out, cfg.resume, cfg.address) == (4, None, None, None)


def test_old_boolean_compile_setting_still_reads(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"compile": True}))
    assert parse_args(["--config", str(path)]).compile == "on"
    path.write_text(json.dumps({"compile": False}))
    assert parse_args(["--config", str(path)]).compile == "off"
    with pytest.raises(SystemExit):
        parse_args(["--compile", "maybe"])


def test_cuda_graphs_setting_is_checked():
    assert parse_args(["--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs", "maybe"])
    with pytest.raises(ConfigError, match="--cuda-graphs"):
        Config(cuda_graphs="yes").validate()
    Config(cuda_graphs="on", compile="off").validate()  # graphs capture eager steps too


def test_cudnn_benchmark_auto_follows_the_runs_length():
    from rayconv.driver.resolve import CUDNN_BENCHMARK_MIN_STEPS, with_cudnn_benchmark

    cfg = Config().validate()
    assert cfg.cudnn_benchmark == "auto"
    assert with_cudnn_benchmark(cfg, CUDNN_BENCHMARK_MIN_STEPS - 1).cudnn_benchmark == "off"
    assert with_cudnn_benchmark(cfg, CUDNN_BENCHMARK_MIN_STEPS).cudnn_benchmark == "on"
    given = Config(cudnn_benchmark="on").validate()
    assert with_cudnn_benchmark(given, 10).cudnn_benchmark == "on"
    with pytest.raises(SystemExit):
        parse_args(["--cudnn-benchmark", "yes"])


@pytest.mark.parametrize("command, argv", [
    ("rayconv.run", ["--step", "20"]), ("rayconv.plan", ["--global-batch", "64"]),
    ("rayconv.prepare", ["--conv", "x"]), ("rayconv.bench", ["--curve-epoch", "1"]),
    ("rayconv.bench.anchor", ["--batc", "8"]), ("rayconv.bench.accuracy_anchor", ["--epoch", "1"])])
def test_every_command_refuses_an_abbreviated_flag(command, argv, capsys):
    """argparse's prefix matching is off in every command: ``--step 20`` is not taken as ``--steps``."""
    import importlib

    module = importlib.import_module(command if command != "rayconv.bench" else "rayconv.bench.__main__")
    parse = {"rayconv.run": parse_args, "rayconv.prepare": lambda a: module._parser().parse_args(a),
             "rayconv.plan": lambda a: module.parse_args(a), "rayconv.bench": lambda a: module.parse_args(a)
             }.get(command, lambda a: module.main(a))
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and "unrecognized arguments: " + argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--stpes", "20"], "; did you mean --steps?"),
                                        (["--global-batchsize=64"], "; did you mean --global-batch-size?"),
                                        (["--zzz", "1"], " (--help lists the flags)")])
def test_a_misspelled_flag_is_told_the_closest_one(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unrecognized arguments: {' '.join(argv)}{said}" in err, err


def test_data_dir_alone_gives_the_data_kind_it_holds(tmp_path):
    """--data-dir without --data: the folder's kind (not the digits beside an unused folder), in the
    Config that config.json and the summary record; a folder of none of them, or --data digits beside a
    folder, refused in one line naming --data."""
    from rayconv import plan

    images, shards, fmnist, other = (tmp_path / n for n in ("images", "shards", "fmnist", "other"))
    for d in (images / "train", images / "val", shards, fmnist, other):
        d.mkdir(parents=True)
    (shards / "manifest.json").write_text("{}")
    (fmnist / "train-images-idx3-ubyte.gz").write_bytes(b"")
    for folder, kind in ((images, "imagefolder"), (shards, "shards"), (fmnist, "fashion-mnist")):
        assert parse_args(["--data-dir", str(folder)]).data == kind
        # as given
        assert parse_args(["--data", "imagefolder", "--data-dir", str(shards)]).data == "imagefolder"
    for argv, words in (
        (["--data-dir", str(other)], "give --data for what it holds"),
        (["--data-dir", str(tmp_path / "none")], "no such folder"),
        (["--data", "digits", "--data-dir", str(images)], "not --data digits: drop --data-dir"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            parse_args(argv)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not --data synthetic"):
        plan._plan(plan.parse_args(["--data", "synthetic", "--data-dir", str(images)]))


def test_the_data_folder_names_are_the_readers():
    """rayconv.data_dir writes the readers' file names out (importing them imports torch)."""
    from rayconv import data_dir
    from rayconv.data import fashion_mnist, shard_files

    assert data_dir.MANIFEST == shard_files.MANIFEST
    assert data_dir.FASHION_MNIST_TRAIN == fashion_mnist.FILES["train"][0]


def test_an_unknown_setting_is_told_the_closest_one(tmp_path):
    """A --config file's unknown key and rayconv.fit's unknown keyword: one line with the closest
    setting (difflib, as for a flag), not every setting's name."""
    import rayconv

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "convnet", "no_progress": True}))
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    msg = str(e.value)
    assert msg.startswith(f"--config {path}: unknown setting(s) no_progress")
    assert msg.endswith("did you mean progress?")
    assert "global_batch_size" not in msg, msg
    with pytest.raises(ConfigError) as e:
        rayconv.fit(no_progress=True)   # (refused before Ray)
    assert str(e.value).endswith("unknown setting(s) no_progress (the flags' names, - as _): "
                                 "did you mean progress?")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) zzz .*--help lists them$"):
        rayconv.fit(zzz=1)


def test_every_number_out_of_its_range_is_refused_naming_its_flag():
    """-1 for each numeric setting (the kind of --seed -1, which every actor failed on): refused by the
    config check, before Ray, naming its flag; -1 is a value only where documented (--max-failures -1:
    no limit). --seed stops at torch's limit."""
    from dataclasses import fields

    from rayconv.flags import flag

    for f in fields(Config):
        t = str(f.type)
        if "bool" in t or not ("int" in t or "float" in t) or f.name == "max_failures":
            continue
        with pytest.raises(ConfigError, match=flag(f.name)):
            Config(**{f.name: -1}).validate()
    assert Config(max_failures=-1, checkpoint_every=5).validate().failure_budget == -1
    with pytest.raises(ConfigError, match="--max-failures"):
        Config(max_failures=-2).validate()
    Config(seed=2**64 - 1).validate()
    with pytest.raises(ConfigError, match=r"--seed must be in \[0, 2\*\*64\)"):
        Config(seed=2**64).validate()
