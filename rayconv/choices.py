"""The named choices of the run's flags and the data sets' own image sides: constants only, so that
the configuration, the flags and each layer that checks a choice share one spelling."""

from __future__ import annotations

MODELS_HELP = ("convnet (small test ConvNet; convnet_bn with batch norm; convnet2col two-column), alexnet, "
               "alexnet2012 (two-column), any torchvision classification ConvNet name, or your own: "
               "MODULE:FUNCTION or path/to/file.py:FUNCTION (called with num_classes, and in_channels and "
               "image_size where it takes them; returns an nn.Module)")
DATA_CHOICES = ("digits", "fashion-mnist", "synthetic", "imagefolder", "shards")
DECODE_CHOICES = ("auto", "cpu", "gpu")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
SCHEDULE_CHOICES = ("gpipe", "1f1b")
PLAN_CHOICES = ("none", "krizhevsky2014")
PRECISION_CHOICES = ("fp32", "bf16", "fp16", "fp64")
LR_SCHEDULE_CHOICES = ("constant", "cosine")
COMPILE_CHOICES = ("auto", "on", "off")
BALANCE_CHOICES = ("auto", "time", "flops")
LAYOUT_CHOICES = ("manual", "auto")
OPT_CHOICES = ("sgd", "sgd_nesterov", "lars", "adamw")  # rayconv.recipe.optim.OPTIMIZERS
LARS_ETA = 0.001  # --lars-trust-coefficient's default, You et al. 2017's eta
WARMUP_CHOICES = ("linear", "constant")         # rayconv.recipe.lr_schedule.WARMUP_METHODS
LR_SCALING_CHOICES = ("none", "linear")
AUGMENT_CHOICES = ("auto", "resized-crop", "pad-crop", "none")
SHUFFLE_CHOICES = ("exact", "block")   # rayconv/data/order.py
AUTO_AUGMENT_CHOICES = ("imagenet", "cifar10", "svhn", "ra", "ta_wide")   # rayconv/data/auto_augment.py
DATA_ON_DEVICE_CHOICES = ("auto", "on", "off")   # rayconv/data/small.py
# --data-on-device auto holds at most this many bytes per actor (rayconv/data/small.py)
SMALL_DATA_BYTES = 1 << 30
HOLD_SHARE = 4               # ... and at most 1/HOLD_SHARE of the memory the actor's copy shares
DATA_ON_DEVICE_HELP = ("--data imagefolder and shards: on: decode both splits once (the loader's center "
                       "crop) into uint8 on each actor's device and augment batches there (refused with "
                       "--augment resized-crop, which needs each image's own size); off: the loader decodes "
                       "each batch; auto: on with pad-crop or none when both splits as uint8 take at most "
                       f"{SMALL_DATA_BYTES / 2**30:g} GiB and 1/{HOLD_SHARE} of the memory each actor's copy "
                       "shares (CPU actors: their node's memory divided among the actors on it; GPUs: the "
                       "GPU's free memory)")
# The side in pixels of each data set's own images (--image-size left out): digits are 8x8 scans,
# Fashion-MNIST 28x28; synthetic, image folders and shards are cropped to 224 (ImageNet's).
# Data whose images are never resized (--image-size refused), and data the augmentation flags reach.
FIXED_SIZE_DATA = ("digits",)
AUGMENTED_DATA = ("fashion-mnist", "imagefolder", "shards")
DATA_IMAGE_SIZE = {"digits": 8, "fashion-mnist": 28, "synthetic": 224, "imagefolder": 224, "shards": 224}
PAD_CROP_MAX_SIZE = 64  # --augment auto: pad-crop + flip up to this side in pixels, resized crops above
CUDNN_BENCHMARK_MIN_STEPS = 10_000  # --cudnn-benchmark auto: on for runs at least this long
