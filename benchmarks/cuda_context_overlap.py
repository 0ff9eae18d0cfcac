"""How long a fresh process takes to be ready to train on a GPU (torch, torchvision and torch._dynamo
imported, the CUDA context made), with the CUDA context made three ways:

  serial   import everything, then the first CUDA call (what a plain script does)
  thread   import torch, then the first CUDA call in a thread while the rest is imported
  driver   the CUDA driver API's primary context made in a thread (ctypes: cuInit and
           cuDevicePrimaryCtxRetain, the context torch's runtime then takes) before torch is imported

Each mode runs REPEAT times in a fresh process, in turn; the line per mode gives each run's seconds from
the process's own start (``/proc/self/stat``) to ready, and the least.

    python benchmarks/cuda_context_overlap.py [REPEAT]        # on a GPU machine
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import ctypes, os, threading, time, sys
mode = sys.argv[1]
def since_start():
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
    up = float(open("/proc/uptime").read().split()[0])
    return up - start
def driver_context():
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cuInit(0) == 0
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
marks = {}
t = None
if mode == "driver":
    t = threading.Thread(target=driver_context); t.start()
import torch
marks["torch"] = since_start()
if mode == "thread":
    t = threading.Thread(target=lambda: torch.zeros(1, device="cuda")); t.start()
import torchvision, torch._dynamo
marks["imports"] = since_start()
if t is not None:
    t.join()
x = torch.ones(4, device="cuda") * 2
torch.cuda.synchronize()
assert float(x.sum()) == 8.0
marks["ready"] = since_start()
print(json.dumps(marks))
"""


def main() -> None:
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    got: dict[str, list[dict]] = {m: [] for m in ("serial", "thread", "driver")}
    for _ in range(repeat):
        for mode in got:
            out = subprocess.run([sys.executable, "-c", "import json\n" + CHILD, mode], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            got[mode].append(json.loads(out))
    for mode, runs in got.items():
        ready = [r["ready"] for r in runs]
        print(f"{mode}: ready after " + ", ".join(f"{s:.2f}" for s in ready) + f" s (least {min(ready):.2f});"
              f" torch imported {min(r['torch'] for r in runs):.2f}, all imported {min(r['imports'] for r in runs):.2f}")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
