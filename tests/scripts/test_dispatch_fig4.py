"""The Figure-4 script runs end to end on the fake CPU devices and records what the lead needs."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fig4_small_writes_json_and_png(tmp_path):
    spec = importlib.util.spec_from_file_location("fig4", ROOT / "experiments" / "fig4_dispatch_latency.py")
    fig4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fig4)
    res = fig4.main(["--small", "--repeats", "1", "--cases", "rows->cols", "rows->reversed", "--out", str(tmp_path)])
    stem = "fig4_dispatch_latency_cpu"
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    assert saved["n_devices"] == 8 and saved["copy_0_to_1"]["GBps"] > 0
    routes = {(r["case"], r["context"]): r["route"] for r in res["rows"]}
    assert set(routes) == {(c, k) for c in ("rows->cols", "rows->reversed") for k in ("8K", "16K", "32K")}
    assert {v for (c, _), v in routes.items() if c == "rows->cols"} == {"reshard"}
    assert {v for (c, _), v in routes.items() if c == "rows->reversed"} == {"two_step"}
    for r in res["rows"]:  # a real layout change: some bytes must cross devices
        assert r["crossing_MiB"] > 0 and all(r[f"{m}_ms"] > 0 for m in ("centralized", "device_put", "earl"))
