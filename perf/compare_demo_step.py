"""Side-by-side step time on the demo model: no checkpointing, HF/PyTorch checkpointing (non-reentrant, per
layer), tapesac policy "none" and "full" — one process, interleaved rounds (order alternating), medians after 3
warm-up rounds. Forward + backward only (no optimizer). A stop-gap until perf/bench_step.py (issue 8).

    python perf/compare_demo_step.py
"""
import copy
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import torch, tapesac
from tapesac.models import tiny_qwen3
torch.manual_seed(0)
base = tiny_qwen3(hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, seed=0)
x = torch.randint(0, 259, (8, 128), generator=torch.Generator().manual_seed(1))
models = {k: copy.deepcopy(base) for k in ("plain", "ckpt", "none", "full")}
models["ckpt"].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
sacs = {k: tapesac.TapeSAC(models[k], blocks="model.layers.*", policy=k) for k in ("none", "full")}
def step(k):
    m = models[k]
    if k in ("plain", "ckpt"):
        m(input_ids=x, labels=x).loss.backward()
    else:
        with sacs[k].step():
            m(input_ids=x, labels=x).loss.backward()
    m.zero_grad(set_to_none=True)
t = {k: [] for k in models}
for r in range(25):
    for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
        t0 = time.perf_counter(); step(k); t[k].append(time.perf_counter() - t0)
med = {k: statistics.median(v[3:]) for k, v in t.items()}
for k in models:
    q = statistics.quantiles(t[k][3:], n=4)
    print(f"{k:6s} median {med[k]*1e3:7.1f} ms  IQR {1e3*(q[2]-q[0]):5.1f}  ratio {med[k]/med['plain']:.3f}")
