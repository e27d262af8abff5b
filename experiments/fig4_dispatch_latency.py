"""Figure 4 of EARL (arXiv 2510.05943): latency of moving the experience batch to the training layout.

The batch holds per-token fields of N responses at 8K / 16K / 32K context (token ids int32, log-probs
float32, advantages float32, loss mask bool: 13 bytes a token), 456 responses per experience worker,
so a worker holds 46 / 93 / 185 MiB like the paper's 46 / 93 / 187 MiB. Three ways to move it:

- centralized: gather every field to host numpy, scatter to the train layout (veRL-style controller),
- device_put:  plain ``jax.device_put(x, target)``,
- earl:        ``Dispatcher`` with route='auto' (noop / one compiled reshard / two_step).

Layout changes on the n available devices (experience = data-parallel log-prob workers, rows of [B, T]):

- rows->cols      train with context parallelism: [B, T] sharded over T (all-to-all),
- rows->repl      tensor-parallel training: every device needs the whole batch (all-gather),
- rows->reversed  train mesh over the same devices in the other order (jit refuses: two_step),
- half->half      disaggregated: experience on the first half of the devices, train on the second.

Also measures the plain whole-array copy device 0 -> device 1 of the same bytes, the yardstick for
"effective bandwidth >= 70% of copy bandwidth". Writes JSON and PNG to experiments/results/.

    python experiments/fig4_dispatch_latency.py            # GPUs: full sizes
    python experiments/fig4_dispatch_latency.py --small    # CPU, 8 fake devices, < 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # only affects the CPU platform: on a machine without GPUs the script still has 8 devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/timing.py

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Bool, Float, Int  # noqa: E402

from earl_jax.parallel.dispatch import Dispatcher  # noqa: E402
from timing import fresh_copy, median_ms  # noqa: E402

FIELDS = {"tokens": np.int32, "logprobs": np.float32, "advantages": np.float32, "loss_mask": np.bool_}
METHODS = ("centralized", "device_put", "earl")


def layouts(devs: list) -> dict[str, tuple[NamedSharding, NamedSharding]]:
    """(experience, train) sharding of a [B, T] field for each layout change."""
    n = len(devs)
    arr = np.asarray(devs, dtype=object)
    mesh = lambda d, names: Mesh(np.asarray(d, dtype=object).reshape(-1), names)  # noqa: E731
    exp = NamedSharding(mesh(arr, ("data",)), P("data"))
    out = {
        "rows->cols": (exp, NamedSharding(mesh(arr, ("fsdp",)), P(None, "fsdp"))),
        "rows->repl": (exp, NamedSharding(mesh(arr, ("tensor",)), P())),
        "rows->reversed": (exp, NamedSharding(mesh(arr[::-1], ("fsdp",)), P("fsdp"))),
    }
    if n >= 2:
        h = n // 2
        out["half->half"] = (NamedSharding(mesh(arr[:h], ("data",)), P("data")),
                             NamedSharding(mesh(arr[h:2 * h], ("fsdp",)), P("fsdp")))
    return out


def crossing_bytes(shape, itemsize, src: NamedSharding, dst: NamedSharding) -> int:
    """Bytes a target device needs but does not already hold (what must cross a link)."""
    total = 0
    have = {}
    for d, idx in src.devices_indices_map(shape).items():
        have.setdefault(d, []).append(idx)
    for d, idx in dst.devices_indices_map(shape).items():
        need = np.zeros([len(range(*sl.indices(n))) for sl, n in zip(idx, shape)], bool)
        off = [sl.indices(n)[0] for sl, n in zip(idx, shape)]
        for h in have.get(d, []):
            lo = [max(a.indices(n)[0], o) - o for a, o, n in zip(h, off, shape)]
            hi = [min(a.indices(n)[1], o + k) - o for a, o, n, k in zip(h, off, shape, need.shape)]
            if all(x < y for x, y in zip(lo, hi)):
                need[tuple(slice(x, y) for x, y in zip(lo, hi))] = True
        total += int((~need).sum())
    return total * itemsize




Batch = dict[str, Int[Array, "B T"] | Float[Array, "B T"] | Bool[Array, "B T"]]


def make_batch(n_resp: int, ctx: int, src: NamedSharding, seed: int = 0) -> Batch:
    """The batch built on device (no host copy of the full size): each field in the experience layout."""
    key = jax.random.key(seed)

    @jax.jit
    def build(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return {"tokens": jax.random.randint(k1, (n_resp, ctx), 0, 151_000, np.int32),
                "logprobs": -jax.random.exponential(k2, (n_resp, ctx), np.float32),
                "advantages": jax.random.normal(k3, (n_resp, ctx), np.float32),
                "loss_mask": jax.random.bernoulli(k4, 0.7, (n_resp, ctx))}

    return jax.jit(build, out_shardings=src)(key)


def copy_bandwidth(nbytes: int, repeats: int) -> dict:
    """Whole array device 0 -> device 1 with jax.device_put (shards map 1:1: a plain peer copy)."""
    d0, d1 = jax.devices()[:2]
    n = nbytes // 4
    a = jax.device_put(jax.numpy.zeros((n,), np.float32), d0)
    ms = median_ms(lambda _: jax.device_put(a, d1), repeats)
    return {"bytes": n * 4, "ms": ms, "GBps": n * 4 / ms / 1e6}


def run(args) -> dict:
    devs = jax.devices()
    if len(devs) < 2:
        raise SystemExit("needs at least 2 devices for a layout change")
    n = len(devs)
    dispatcher = Dispatcher()
    rows = []
    bpt = sum(np.dtype(t).itemsize for t in FIELDS.values())
    for ctx_label, ctx in zip(args.context_labels, args.contexts):
        for case, (src, dst) in layouts(devs).items():
            if args.cases and case not in args.cases:
                continue
            n_exp = len(src.device_set)
            n_resp = args.responses_per_worker * n
            batch = make_batch(n_resp, ctx, src)
            jax.block_until_ready(batch)
            total = sum(v.nbytes for v in batch.values())
            moves = {"centralized": lambda b: dispatcher(b, dst, route="centralized"),
                     "device_put": lambda b: dispatcher(b, dst, route="device_put"),
                     "earl": lambda b: dispatcher(b, dst)}
            out = moves["earl"](fresh_copy(batch))
            route = dispatcher.last.route
            for k, v in batch.items():  # exact, checked once per size (outside the timed loop)
                assert np.array_equal(np.asarray(out[k]), np.asarray(v)), (case, k)
                assert out[k].sharding == dst
            del out
            r = {"context": ctx_label, "T": ctx, "case": case, "route": route, "responses": n_resp,
                 "MiB_total": total / 2**20, "MiB_per_worker": total / n_exp / 2**20,
                 "crossing_MiB": sum(crossing_bytes(v.shape, v.dtype.itemsize, src, dst)
                                     for v in batch.values()) / 2**20}
            for m in METHODS:
                r[f"{m}_ms"] = median_ms(moves[m], args.repeats, setup=lambda: fresh_copy(batch))  # noqa: F821 (`del`-ed below)
            r["x_vs_centralized"] = r["centralized_ms"] / r["earl_ms"]
            r["x_vs_device_put"] = r["device_put_ms"] / r["earl_ms"]
            r["effective_GBps"] = total / r["earl_ms"] / 1e6            # batch bytes per second
            r["link_GBps"] = r["crossing_MiB"] * 2**20 / r["earl_ms"] / 1e6  # bytes that changed device
            rows.append(r)
            del batch
        print(f"done {ctx_label}", flush=True)
    biggest = max(r["MiB_total"] for r in rows) * 2**20
    copy = copy_bandwidth(int(min(biggest, args.copy_cap_mib * 2**20)), args.repeats)
    for r in rows:
        r["effective_vs_copy"] = r["effective_GBps"] / copy["GBps"]
        r["link_vs_copy"] = r["link_GBps"] / copy["GBps"]
    return {"device_kind": devs[0].device_kind, "platform": devs[0].platform, "n_devices": n,
            "jax": jax.__version__, "bytes_per_token": bpt, "responses_per_worker": args.responses_per_worker,
            "repeats": args.repeats, "small": args.small, "copy_0_to_1": copy, "rows": rows}


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Dispatch latency, experience -> train ({res['n_devices']} x {res['device_kind']}, "
                    f"median of {res['repeats']})")
    for c in ("ctx", "case", "route", "MiB/worker", "central ms", "device_put ms", "earl ms", "x central",
              "x device_put", "eff GB/s", "link GB/s", "eff/copy"):
        t.add_column(c, justify="right")
    for r in res["rows"]:
        t.add_row(r["context"], r["case"], r["route"], f"{r['MiB_per_worker']:.1f}", f"{r['centralized_ms']:.2f}",
                  f"{r['device_put_ms']:.2f}", f"{r['earl_ms']:.3f}", f"{r['x_vs_centralized']:.1f}",
                  f"{r['x_vs_device_put']:.1f}", f"{r['effective_GBps']:.1f}", f"{r['link_GBps']:.1f}",
                  f"{100 * r['effective_vs_copy']:.0f}%")
    c = res["copy_0_to_1"]
    con = Console(width=200)
    con.print(t)
    con.print(f"copy device 0 -> 1: {c['bytes'] / 2**20:.0f} MiB in {c['ms']:.3f} ms = {c['GBps']:.1f} GB/s")


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in res["rows"]))
    ctxs = list(dict.fromkeys(r["context"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.8), squeeze=False)
    w = 0.27
    colors = {"centralized": "#b0b0b0", "device_put": "#7fa7d6", "earl": "#d9534f"}
    for ax, case in zip(axes[0], cases):
        rs = {r["context"]: r for r in res["rows"] if r["case"] == case}
        x = np.arange(len(ctxs))
        for k, m in enumerate(METHODS):
            ax.bar(x + (k - 1) * w, [rs[c][f"{m}_ms"] for c in ctxs], w, label=m, color=colors[m])
        for i, c in enumerate(ctxs):
            ax.annotate(f"{rs[c]['x_vs_centralized']:.0f}x", (x[i] + w, rs[c]["earl_ms"]), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(x, ctxs)
        ax.set_yscale("log")
        ax.set_title(f"{case} ({rs[ctxs[0]]['route']})", fontsize=10)
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("dispatch latency (ms, median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Experience -> train dispatch, {res['n_devices']} x {res['device_kind']}"
                 + (" (small sizes)" if res["small"] else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", default=None, help="tiny sizes (default on CPU)")
    p.add_argument("--full", dest="small", action="store_false", help="paper sizes even on CPU")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--responses-per-worker", type=int, default=None)
    p.add_argument("--cases", nargs="*", default=None, help="subset of rows->cols rows->repl rows->reversed half->half")
    p.add_argument("--copy-cap-mib", type=float, default=1024.0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.small is None:
        args.small = jax.devices()[0].platform == "cpu"
    args.context_labels = ["8K", "16K", "32K"]
    args.contexts = [8192, 16384, 32768]
    if args.small:  # same three steps, 1/32 of the context and few responses
        args.contexts = [c // 32 for c in args.contexts]
        args.responses_per_worker = args.responses_per_worker or 16
        args.repeats = args.repeats or 5
    args.responses_per_worker = args.responses_per_worker or 456
    args.repeats = args.repeats or 10
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    from earl_jax.parallel.profile import device_slug

    stem = f"fig4_dispatch_latency_{device_slug(res['device_kind'], res['n_devices'])}"
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot(res, args.out / f"{stem}.png")
    print_table(res)
    print(f"wrote {args.out / stem}.json and .png")
    return res


if __name__ == "__main__":
    main()
