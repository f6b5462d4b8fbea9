"""fusedfp8.policy, the framework-free half of ``policy='auto'``: the calibration table (JSON round
trip, validation, one grid per measured mode, the eager-only format /1 still read), the
prediction (measured at a grid point, interpolated in log space between them, the edge value
outside the grid), the decision per execution mode ('compiled' from the graphed grid) and its
report, the errors for a bad mode and for a mode the table lacks, and which table is used
(argument, $FUSEDFP8_POLICY_TABLE, the table shipped for the GPU's name, the error without one).
Every table here is SYNTHETIC (tests/support/policy.py): none of its numbers was measured."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from fusedfp8 import policy as P
from support.policy import (FEATURES, GRAPHED_FEATURES, SYNTHETIC_DEVICE, TOKENS, fp8_wins, machine_paths,
                            synthetic_ms, synthetic_points, synthetic_table)


@pytest.fixture
def no_env_table(monkeypatch):
    monkeypatch.delenv(P.TABLE_ENV, raising=False)


@pytest.fixture
def data_dir(monkeypatch, tmp_path, no_env_table):
    """An empty stand-in for fusedfp8/data/ (the shipped tables)."""
    d = tmp_path / "data"
    d.mkdir()
    monkeypatch.setattr(P, "DATA_DIR", d)
    return d


def test_policy_imports_no_framework():
    """Nor ml_dtypes (a second to import): only code that makes FP8 numpy arrays needs it."""
    code = ("import sys, fusedfp8.policy; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'ml_dtypes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the table -------------------------------------------------------------------------------
def test_table_round_trips_through_json(tmp_path):
    path = tmp_path / "t.json"
    table = synthetic_table(path)
    data = json.loads(path.read_text())
    assert data["format"] == "fusedfp8-policy-table/2" and data["device"] == SYNTHETIC_DEVICE
    assert data["meta"]["synthetic"] is True and list(data["modes"]) == ["eager", "graphed"]
    assert len(data["modes"]["eager"]["points"]) == 27 and len(data["modes"]["graphed"]["points"]) == 12
    back = P.PolicyTable.load(path)
    assert back.to_dict() == table.to_dict() and back.path == path and back.modes == ("eager", "graphed")
    assert back.grid("eager").axes == ((16, 64, 256),) * 3
    assert back.grid("graphed").axes == ((16, 64, 256), (16, 256), (16, 256))
    assert back.grid("compiled").mode == "graphed"
    assert back.describe().startswith("t.json (Synthetic GPU")
    assert back.describe().endswith("fusedfp8 test; eager, graphed steps)")
    eager_only = synthetic_table(tmp_path / "e.json", graphed=False)
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["modes"]["graphed"] == {"missing": "synthetic table without graphed steps"}
    assert P.PolicyTable.load(tmp_path / "e.json").to_dict() == eager_only.to_dict() and eager_only.modes == ("eager",)


@pytest.mark.parametrize("mode, grid", [("eager", "eager"), ("graphed", "graphed"), ("compiled", "graphed")])
def test_prediction_at_grid_points_is_the_measurement_of_the_modes_grid(mode, grid):
    table = synthetic_table()
    for t, i, o in [(16, 16, 16), (64, 256, 16), (256, 256, 256), (16, 16, 256)]:
        fp8_ms, bf16_ms, how = table.predict(t, i, o, mode=mode)
        want_b, want_f = synthetic_ms(t, i, o, grid)
        assert how == "measured"
        assert math.isclose(fp8_ms, want_f, rel_tol=1e-12) and math.isclose(bf16_ms, want_b, rel_tol=1e-12)
        d = table.decide(t, i, o, mode=mode)
        assert d.fp8 == fp8_wins(t, i, o, grid) and d.mode == mode and (d.fp8_ms, d.bf16_ms) == (fp8_ms, bf16_ms)


def test_the_mode_changes_the_decision():
    """16 x 16 -> 256 (65,536 MACs) is below the eager crossover (240,000) and above the graphed
    one (12,000); 'compiled' decides as 'graphed' and says it is an approximation."""
    table = synthetic_table()
    eager, graphed, compiled = (table.decide(16, 16, 256, name="fc", mode=m) for m in P.MODES)
    assert (eager.fp8, graphed.fp8, compiled.fp8) == (False, True, True)
    assert eager.reason.startswith("auto, eager: fp8 predicted slower (0.")
    assert graphed.reason == f"auto, graphed: fp8 predicted {graphed.bf16_ms / graphed.fp8_ms:.2f}x faster"
    assert compiled.reason.startswith("auto, compiled: fp8 predicted ")
    assert eager.source == "table, eager steps: measured" and graphed.source == "table, graphed steps: measured"
    assert compiled.source == "table, graphed steps (approximating compiled): measured"
    assert (compiled.fp8_ms, compiled.bf16_ms) == (graphed.fp8_ms, graphed.bf16_ms) != (eager.fp8_ms, eager.bf16_ms)
    assert table.decide(16, 16, 256).mode == "eager"  # the table's default mode


def test_the_graphed_grid_interpolates_between_its_own_points():
    """64 features lie half way between the graphed grid's 16 and 256 in log2 (the eager grid
    measured 64 itself): the geometric mean of the four (in, out) corners."""
    table = synthetic_table()
    fp8_ms, bf16_ms, how = table.predict(64, 64, 64, mode="graphed")
    corners = [synthetic_ms(64, i, o, "graphed") for i in GRAPHED_FEATURES for o in GRAPHED_FEATURES]
    assert how == "interpolated" and table.predict(64, 64, 64)[2] == "measured"
    assert math.isclose(math.log(bf16_ms), sum(math.log(b) for b, _ in corners) / 4, rel_tol=1e-12)
    assert math.isclose(math.log(fp8_ms), sum(math.log(f) for _, f in corners) / 4, rel_tol=1e-12)


def test_interpolation_is_linear_in_log_space():
    """Half way in log2 on one axis: the geometric mean of the two neighbours' times, so the
    speed-up is the geometric mean of theirs; on every axis at once: the mean of the 8 corners' logs."""
    table = synthetic_table()
    fp8_ms, bf16_ms, how = table.predict(32, 64, 64)  # 32: half way between 16 and 64 in log2
    (b0, f0), (b1, f1) = synthetic_ms(16, 64, 64), synthetic_ms(64, 64, 64)
    assert how == "interpolated"
    assert math.isclose(bf16_ms, math.sqrt(b0 * b1), rel_tol=1e-12)
    assert math.isclose(fp8_ms, math.sqrt(f0 * f1), rel_tol=1e-12)
    assert math.isclose(bf16_ms / fp8_ms, math.sqrt(b0 / f0 * b1 / f1), rel_tol=1e-12)
    fp8_ms, bf16_ms, _ = table.predict(32, 32, 128)
    corners = [synthetic_ms(t, i, o) for t in (16, 64) for i in (16, 64) for o in (64, 256)]
    assert math.isclose(math.log(bf16_ms), sum(math.log(b) for b, _ in corners) / 8, rel_tol=1e-12)
    assert math.isclose(math.log(fp8_ms), sum(math.log(f) for _, f in corners) / 8, rel_tol=1e-12)
    fp8_ms, _, _ = table.predict(24, 64, 64)  # off centre: weight log2(24 / 16) / log2(64 / 16) = 0.29 on 64
    w = math.log2(24 / 16) / 2
    assert math.isclose(math.log(fp8_ms), (1 - w) * math.log(f0) + w * math.log(f1), rel_tol=1e-12)


def test_outside_the_grid_takes_the_edge_value_and_says_so():
    table = synthetic_table()
    assert table.predict(4096, 64, 64)[:2] == table.predict(256, 64, 64)[:2]
    assert table.predict(4096, 64, 64)[2] == "grid edge (tokens > 256)"
    assert table.predict(1, 8, 300)[2] == "grid edge (tokens < 16, in_features < 16, out_features > 256)"
    assert table.predict(1, 16, 16)[:2] == table.predict(16, 16, 16)[:2]
    d = table.decide(1, 8, 300, name="x")
    assert d.source == "table, eager steps: grid edge (tokens < 16, in_features < 16, out_features > 256)"
    assert table.predict(64, 512, 64, mode="graphed")[2] == "grid edge (in_features > 256)"


def test_decision_and_report():
    table = synthetic_table()
    small, big = (table.decide(16, 16, 16, name="small", mode="graphed"),
                  table.decide(256, 256, 256, name="big", mode="graphed"))
    assert (small.fp8, big.fp8) == (False, True)
    assert small.reason.startswith("auto, graphed: fp8 predicted slower (0.")
    assert big.reason.startswith("auto, graphed: fp8 predicted ")
    assert big.speedup == big.bf16_ms / big.fp8_ms > 1 and small.tokens == 16
    assert big.source == "table, graphed steps: measured"
    kept = P.Decision("head", None, 16, 8, False, "filter_fn returned False")
    report = P.ConversionReport("auto", 256, table.describe(), (small, big, kept), "graphed")
    assert report.converted == ["big"] and report.kept == ["small", "head"] and len(report) == 3
    assert report["big"] is big and list(report) == [small, big, kept]
    with pytest.raises(KeyError):
        report["nothing"]
    assert report.rows()[2] == ("head", 16, 8, "bf16", None, None, "")
    text = str(report)
    assert text.splitlines()[0] == ("fusedfp8 conversion: policy='auto', mode='graphed', tokens=256, table (in memory) "
                                    "(Synthetic GPU (test table, not measured), 2000-01-01, fusedfp8 test; eager, "
                                    "graphed steps); 1 of 3 linear layers converted to FP8")
    assert "| layer | in | out | decision | reason | fp8 ms | bf16 ms | speed-up | source |" in text
    assert (f"| big | 256 | 256 | fp8 | {big.reason} | {big.fp8_ms:.4f} | {big.bf16_ms:.4f} | {big.speedup:.2f}x | "
            "table, graphed steps: measured |") in text
    assert "| head | 16 | 8 | bf16 | filter_fn returned False | - | - | - | - |" in text
    assert str(P.ConversionReport("all", None, "", (kept,))).splitlines()[0] == (
        "fusedfp8 conversion: policy='all'; 0 of 1 linear layers converted to FP8")


# ---- modes: bad values, a mode the table lacks, the eager-only format /1 --------------------------
@pytest.mark.parametrize("mode", ["jit", "Eager", None, 1, ("eager",)], ids=["jit", "case", "none", "int", "tuple"])
def test_a_bad_mode_is_refused_naming_the_argument_and_the_choices(mode):
    table = synthetic_table()
    match = (r"^mode must be one of 'eager', 'graphed', 'compiled' \(how the model's steps run: eagerly, replayed "
             rf"from CUDA graphs, or compiled by torch\.compile / jax\.jit\); got {re.escape(repr(mode))}$")
    for call in (lambda: table.decide(64, 64, 64, mode=mode), lambda: table.predict(64, 64, 64, mode=mode),
                 lambda: table.grid(mode), lambda: P.decide(64, 64, 64, mode=mode, table=table),
                 lambda: P.decide(64, 64, 64, policy="all", mode=mode)):
        with pytest.raises(ValueError, match=match):
            call()


def _eager_only_v1(tmp_path):
    """A table file of the eager-only format /1: its points at the top level."""
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "fusedfp8-policy-table/1", "device": "NVIDIA H200", "date": "2000-01-01",
                                "versions": {"fusedfp8": "test"}, "meta": {"synthetic": True},
                                "points": synthetic_points()}))
    return path


def test_the_eager_only_format_1_is_read_as_a_table_without_graphed_steps(tmp_path):
    table = P.PolicyTable.load(_eager_only_v1(tmp_path))
    assert table.modes == ("eager",) and table.grid("eager").axes == (TOKENS, FEATURES, FEATURES)
    assert table.missing == {"graphed": "a fusedfp8-policy-table/1 table holds eager steps only"}
    assert table.describe() == "v1.json (NVIDIA H200, 2000-01-01, fusedfp8 test; eager steps)"
    d = table.decide(16, 16, 256, name="fc")
    assert not d.fp8 and d.source == "v1.json, eager steps: measured"
    want_b, want_f = synthetic_ms(16, 16, 256)
    assert math.isclose(d.fp8_ms, want_f, rel_tol=1e-12) and math.isclose(d.bf16_ms, want_b, rel_tol=1e-12)
    table.save(tmp_path / "v2.json")  # written in the current format, its graphed mode missing
    data = json.loads((tmp_path / "v2.json").read_text())
    assert data["format"] == "fusedfp8-policy-table/2" and data["modes"]["graphed"] == {
        "missing": "a fusedfp8-policy-table/1 table holds eager steps only"}
    assert data["modes"]["eager"]["points"] == synthetic_points()
    assert P.PolicyTable.load(tmp_path / "v2.json").to_dict() == table.to_dict()


@pytest.mark.parametrize("mode", ["graphed", "compiled"])
def test_a_mode_the_table_lacks_raises_saying_how_to_measure_it(tmp_path, mode):
    path = _eager_only_v1(tmp_path)
    table = P.PolicyTable.load(path)
    also = r" \(compiled steps are decided from graphed ones\)" if mode == "compiled" else ""
    match = (rf"^policy table v1\.json \(NVIDIA H200, 2000-01-01, fusedfp8 test; eager steps\) has no graphed "
             rf"measurements \(a fusedfp8-policy-table/1 table holds eager steps only\), which mode='{mode}' "
             rf"needs{also}; it measured eager steps only\. Measure every mode on this GPU with `python -m fusedfp8 "
             r"bench --calibrate` \(it says where it wrote the table\) and pass that table \(policy_table=PATH, or "
             r"set FUSEDFP8_POLICY_TABLE=PATH\); or decide with mode='eager'")
    for call in (lambda: table.decide(64, 64, 64, mode=mode), lambda: table.grid(mode),
                 lambda: P.decide(64, 64, 64, mode=mode, table=path)):
        with pytest.raises(P.MissingModeError, match=match):
            call()
    assert issubclass(P.MissingModeError, P.MissingTableError)  # one except clause catches both
    assert P.decide(64, 64, 64, mode="eager", table=path).fp8 == fp8_wins(64, 64, 64)
    assert P.decide(64, 64, 64, policy="all", mode=mode, table=None).fp8  # 'all' reads no table


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(format="other/1"), r"'format' must be 'fusedfp8-policy-table/2' \(or the eager-only "
                                           r"'fusedfp8-policy-table/1'\); got 'other/1'"),
    (lambda d: d.update(device=""), r"'device' must be the GPU's name"),
    (lambda d: d.pop("modes"), r"'modes' must be an object with the keys \['eager', 'graphed'\]; got NoneType"),
    (lambda d: d["modes"].update(jit={}), r"'modes' may only hold \['eager', 'graphed'\]; got \['jit'\]"),
    (lambda d: d["modes"].update(graphed=[]), r"modes\.graphed must be an object; got list"),
    (lambda d: d["modes"].update(graphed={"missing": ""}), r"modes\.graphed must be either measured \(\{'points', "
                                                           r"'meta'\}\) or \{'missing': 'why'\}"),
    (lambda d: d["modes"]["graphed"].update(missing="why"), r"modes\.graphed must be either measured"),
    (lambda d: d["modes"].update(eager={"missing": "x"}, graphed={"missing": "y"}),
     r"no mode is measured \(every one of \['eager', 'graphed'\] is missing\)"),
    (lambda d: d["modes"]["eager"].update(points=[]), r"modes\.eager: 'points' must be a non-empty list"),
    (lambda d: d["modes"]["eager"].update(meta=[]), r"modes\.eager: 'meta' must be an object; got list"),
    (lambda d: d["modes"]["eager"]["points"].pop(5),
     r"modes\.eager: the points must cover the whole grid tokens \[16, 64, 256\] x in_features \[16, 64, 256\] x "
     r"out_features \[16, 64, 256\] \(27 points\); got 26, missing e\.g\. tokens=16, in_features=64, "
     r"out_features=256"),
    (lambda d: d["modes"]["graphed"]["points"].pop(0),
     r"modes\.graphed: the points must cover the whole grid tokens \[16, 64, 256\] x in_features \[16, 256\] x "
     r"out_features \[16, 256\] \(12 points\); got 11"),
    (lambda d: d["modes"]["eager"]["points"].append(dict(d["modes"]["eager"]["points"][0])),
     r"modes\.eager: the point tokens=16, in_features=16, out_features=16 appears twice"),
    (lambda d: d["modes"]["graphed"]["points"][3].update(fp8_ms=-1.0),
     r"modes\.graphed: points\[3\]\.fp8_ms must be a positive finite number of ms; got -1\.0"),
    (lambda d: d["modes"]["eager"]["points"][3].update(bf16_ms=float("nan")),
     r"modes\.eager: points\[3\]\.bf16_ms must be a positive finite"),
    (lambda d: d["modes"]["eager"]["points"][4].update(tokens=64.0),
     r"modes\.eager: points\[4\]\.tokens must be a positive int; got 64\.0"),
    (lambda d: d["modes"]["eager"]["points"][4].pop("in_features"),
     r"modes\.eager: points\[4\]\.in_features must be a positive int; got None"),
], ids=["format", "device", "no-modes", "unknown-mode", "mode-not-an-object", "empty-why", "missing-and-points",
        "nothing-measured", "no-points", "meta-not-an-object", "missing-point", "graphed-missing-point", "duplicate",
        "negative-ms", "nan-ms", "float-tokens", "no-in-features"])
def test_malformed_tables_are_refused_naming_the_file_mode_and_field(tmp_path, change, match):
    path = tmp_path / "bad.json"
    data = synthetic_table().to_dict()
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^policy table {path}: {match}"):
        P.PolicyTable.load(path)


def test_a_malformed_eager_only_table_names_its_points(tmp_path):
    path = _eager_only_v1(tmp_path)
    data = json.loads(path.read_text())
    data["points"][2]["fp8_ms"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^policy table {path}: modes\.eager: points\[2\]\.fp8_ms must be a "
                                         r"positive finite number of ms; got 0"):
        P.PolicyTable.load(path)


def test_not_json_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{points")
    with pytest.raises(ValueError, match=f"^policy table {path}: not valid JSON"):
        P.PolicyTable.load(path)


# ---- which table -----------------------------------------------------------------------------
def test_table_file_name_of_a_gpu():
    assert P.table_file_name("NVIDIA H200") == "policy_nvidia_h200.json"
    assert P.table_file_name("NVIDIA H100 80GB HBM3") == "policy_nvidia_h100_80gb_hbm3.json"


def test_the_shipped_table_is_chosen_by_the_gpus_name(data_dir):
    synthetic_table(data_dir / "policy_nvidia_h200.json", device="NVIDIA H200")
    synthetic_table(data_dir / "policy_nvidia_h100_80gb_hbm3.json", device="NVIDIA H100 80GB HBM3")
    assert P.find_table("NVIDIA H200").device == "NVIDIA H200"
    assert P.find_table("NVIDIA H100 80GB HBM3").path == data_dir / "policy_nvidia_h100_80gb_hbm3.json"
    with pytest.raises(P.MissingTableError, match=r"no calibration table for the GPU 'NVIDIA A100-SXM4-80GB' "
                                                  r"\(policy_nvidia_a100_sxm4_80gb\.json\); fusedfp8 ships tables for "
                                                  r"policy_nvidia_h100_80gb_hbm3\.json, policy_nvidia_h200\.json\. "
                                                  r"`python -m fusedfp8 bench --calibrate` measures one"):
        P.find_table("NVIDIA A100-SXM4-80GB")


def test_missing_table_errors_say_how_to_measure_one(data_dir):
    with pytest.raises(P.MissingTableError, match=r"fusedfp8 ships no table yet\. `python -m fusedfp8 bench "
                                                  r"--calibrate` measures one on the GPU .* set "
                                                  r"FUSEDFP8_POLICY_TABLE=PATH"):
        P.find_table("NVIDIA H200")
    with pytest.raises(P.MissingTableError, match=r"picks its calibration table by the GPU's name, and no CUDA device "
                                                  r"is visible here"):
        P.find_table(None)
    with pytest.raises(P.MissingTableError):
        P.decide(256, 256, 256, device=None)


def test_a_shipped_table_must_be_of_the_gpu_its_name_says(data_dir):
    synthetic_table(data_dir / "policy_nvidia_h200.json", device="NVIDIA H100")
    with pytest.raises(ValueError, match=r"measured on 'NVIDIA H100', but its file name is that of 'NVIDIA H200'"):
        P.find_table("NVIDIA H200")


def test_argument_then_environment_then_shipped(data_dir, monkeypatch, tmp_path):
    synthetic_table(data_dir / "policy_nvidia_h200.json", device="NVIDIA H200")
    env = synthetic_table(tmp_path / "env.json", device="from the environment")
    arg = synthetic_table(tmp_path / "arg.json", device="from the argument")
    monkeypatch.setenv(P.TABLE_ENV, str(env.path))
    assert P.find_table("NVIDIA H200").device == "from the environment"
    assert P.find_table(None).device == "from the environment"
    assert P.find_table("NVIDIA H200", arg.path).device == "from the argument"
    assert P.find_table("NVIDIA H200", str(arg.path)).device == "from the argument"
    assert P.find_table(None, arg) is arg
    monkeypatch.setenv(P.TABLE_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(FileNotFoundError, match=rf"\$FUSEDFP8_POLICY_TABLE names '{tmp_path}/gone\.json', which is "
                                                r"not a file; measure a table with `python -m fusedfp8 bench"):
        P.find_table("NVIDIA H200")
    with pytest.raises(FileNotFoundError, match="the policy table argument names"):
        P.find_table("NVIDIA H200", tmp_path / "nope.json")
    with pytest.raises(TypeError, match="policy table must be a fusedfp8.policy.PolicyTable, a path to a JSON table or "
                                        "None; got int"):
        P.find_table("NVIDIA H200", 3)


def test_decide(data_dir):
    synthetic_table(data_dir / "policy_nvidia_h200.json", device="NVIDIA H200")
    d = P.decide(256, 256, 256, device="NVIDIA H200", name="fc")
    assert d.fp8 and d.name == "fc" and d.source == "policy_nvidia_h200.json, eager steps: measured"
    assert d.mode == "eager"  # the default
    assert not P.decide(16, 16, 256, device="NVIDIA H200").fp8
    assert P.decide(16, 16, 256, device="NVIDIA H200", mode="graphed").fp8
    everything = P.decide(16, 16, 16, policy="all")  # no table consulted
    assert everything.fp8 and everything.reason == "policy='all'" and everything.fp8_ms is None
    assert everything.mode is None
    with pytest.raises(ValueError, match=r"^policy must be one of 'all', 'auto'; got 'fast'"):
        P.decide(16, 16, 16, policy="fast")
    with pytest.raises(TypeError, match=r"^tokens must be a positive int; got float"):
        P.decide(16.0, 16, 16, policy="all")
    with pytest.raises(TypeError, match=r"^in_features must be a positive int; got bool"):
        P.decide(16, True, 16, policy="all")
    with pytest.raises(ValueError, match=r"^out_features must be a positive int; got 0"):
        P.decide(16, 16, 0, policy="all")


def test_shipped_tables_are_measured_ones():
    """A table in fusedfp8/data/ is a real measurement of the GPU its file is named after (none
    is shipped until one has been measured on that GPU), of the current format, with its eager grid
    over the calibration's default grid; a mode it lacks raises MissingModeError saying how to
    measure it. The H200 table holds eager and graphed steps (docs/policy.md says so)."""
    assert P.PolicyTable.load(P.DATA_DIR / "policy_nvidia_h200.json").modes == ("eager", "graphed")
    for path in P.shipped_tables():
        table = P.PolicyTable.load(path)
        assert json.loads(path.read_text())["format"] == P.TABLE_FORMAT
        assert path.name == P.table_file_name(table.device)
        assert table.meta.get("clock") == "CUDA events" and not table.meta.get("smoke_test")
        assert not table.meta.get("synthetic")
        default = ((512, 1024, 2048, 4096, 8192),) + ((256, 512, 1024, 2048, 4096, 8192, 16384),) * 2
        assert table.grid("eager").axes == default
        for mode in P.MODES:
            if P.MEASURED_AS[mode] in table.modes:
                assert table.decide(2048, 1024, 4096, mode=mode).mode == mode
            else:
                with pytest.raises(P.MissingModeError, match="`python -m fusedfp8 bench --calibrate`"):
                    table.decide(2048, 1024, 4096, mode=mode)


def _strings(value):
    """Every string of a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_no_shipped_data_file_names_a_machine_path():
    """What fusedfp8/data/ ships names no path of the machine that made it (the calibration once
    wrote its command line and the shim's path there): every string of every JSON file, and every
    other file's text. The pattern finds the paths such a file held."""
    assert machine_paths("C++ / built at install time: /work/main/fusedfp8/csrc/_ff8_torch.so") == [
        "/work/main/fusedfp8/csrc/_ff8_torch.so"]
    assert machine_paths("calibrate_policy.py --out /tmp/res/policy_nvidia_h200.json") == [
        "/tmp/res/policy_nvidia_h200.json"]
    files = sorted(p for p in P.DATA_DIR.iterdir() if p.is_file())
    assert any(p.suffix == ".json" for p in files)
    for path in files:
        texts = _strings(json.loads(path.read_text())) if path.suffix == ".json" else [path.read_text()]
        found = [p for t in texts for p in machine_paths(t)]
        assert not found, (path.name, found)


@pytest.mark.parametrize("mode, features", [("eager", FEATURES), ("graphed", GRAPHED_FEATURES)])
def test_synthetic_grid_covers_both_decisions(mode, features):
    pts = synthetic_points(features=features, mode=mode)
    assert {fp8_wins(p["tokens"], p["in_features"], p["out_features"], mode) for p in pts} == {True, False}
