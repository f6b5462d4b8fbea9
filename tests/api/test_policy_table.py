"""fusedfp8.policy, the framework-free half of ``policy='auto'``: the calibration table (JSON round
trip, validation), the prediction (measured at a grid point, interpolated in log space between
them, the edge value outside the grid), the decision and its report, and which table is used
(argument, $FUSEDFP8_POLICY_TABLE, the table shipped for the GPU's name, the error without one).
Every table here is SYNTHETIC (tests/support/policy.py): none of its numbers was measured."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fusedfp8 import policy as P
from support.policy import SYNTHETIC_DEVICE, fp8_wins, synthetic_ms, synthetic_points, synthetic_table


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
    code = "import sys, fusedfp8.policy; print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the table -------------------------------------------------------------------------------
def test_table_round_trips_through_json(tmp_path):
    path = tmp_path / "t.json"
    table = synthetic_table(path)
    data = json.loads(path.read_text())
    assert data["format"] == "fusedfp8-policy-table/1" and data["device"] == SYNTHETIC_DEVICE
    assert data["meta"]["synthetic"] is True and len(data["points"]) == 27
    back = P.PolicyTable.load(path)
    assert back.to_dict() == table.to_dict() and back.path == path
    assert back.axes == ((16, 64, 256),) * 3
    assert "t.json (Synthetic GPU" in back.describe() and "fusedfp8 test" in back.describe()


def test_prediction_at_grid_points_is_the_measurement():
    table = synthetic_table()
    for t, i, o in [(16, 16, 16), (64, 256, 16), (256, 256, 256)]:
        fp8_ms, bf16_ms, how = table.predict(t, i, o)
        want_b, want_f = synthetic_ms(t, i, o)
        assert how == "measured"
        assert math.isclose(fp8_ms, want_f, rel_tol=1e-12) and math.isclose(bf16_ms, want_b, rel_tol=1e-12)
        assert table.decide(t, i, o).fp8 == fp8_wins(t, i, o)


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
    assert d.source.endswith(": grid edge (tokens < 16, in_features < 16, out_features > 256)")


def test_decision_and_report():
    table = synthetic_table()
    small, big = table.decide(16, 16, 16, name="small"), table.decide(256, 256, 256, name="big")
    assert (small.fp8, big.fp8) == (False, True)
    assert small.reason.startswith("auto: fp8 predicted slower (0.") and big.reason.startswith("auto: fp8 predicted ")
    assert big.speedup == big.bf16_ms / big.fp8_ms > 1 and small.tokens == 16
    assert big.source == "table: measured"
    kept = P.Decision("head", None, 16, 8, False, "filter_fn returned False")
    report = P.ConversionReport("auto", 256, table.describe(), (small, big, kept))
    assert report.converted == ["big"] and report.kept == ["small", "head"] and len(report) == 3
    assert report["big"] is big and list(report) == [small, big, kept]
    with pytest.raises(KeyError):
        report["nothing"]
    assert report.rows()[2] == ("head", 16, 8, "bf16", None, None, "")
    text = str(report)
    assert text.splitlines()[0] == ("fusedfp8 conversion: policy='auto', tokens=256, table (in memory) (Synthetic GPU "
                                    "(test table, not measured), 2000-01-01, fusedfp8 test); 1 of 3 linear layers "
                                    "converted to FP8")
    assert "| layer | in | out | decision | reason | fp8 ms | bf16 ms | speed-up | source |" in text
    assert f"| big | 256 | 256 | fp8 | {big.reason} | {big.fp8_ms:.4f} | {big.bf16_ms:.4f} | {big.speedup:.2f}x |" in text
    assert "| head | 16 | 8 | bf16 | filter_fn returned False | - | - | - | - |" in text


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(format="other/1"), r"'format' must be 'fusedfp8-policy-table/1'; got 'other/1'"),
    (lambda d: d.update(device=""), r"'device' must be the GPU's name"),
    (lambda d: d.update(points=[]), r"'points' must be a non-empty list"),
    (lambda d: d["points"].pop(5), r"the points must cover the whole grid tokens \[16, 64, 256\] x in_features "
                                   r"\[16, 64, 256\] x out_features \[16, 64, 256\] \(27 points\); got 26, missing "
                                   r"e\.g\. tokens=16, in_features=64, out_features=256"),
    (lambda d: d["points"].append(dict(d["points"][0])), r"the point tokens=16, in_features=16, out_features=16 "
                                                         r"appears twice"),
    (lambda d: d["points"][3].update(fp8_ms=-1.0), r"points\[3\]\.fp8_ms must be a positive finite number of ms; "
                                                   r"got -1\.0"),
    (lambda d: d["points"][3].update(bf16_ms=float("nan")), r"points\[3\]\.bf16_ms must be a positive finite"),
    (lambda d: d["points"][4].update(tokens=64.0), r"points\[4\]\.tokens must be a positive int; got 64\.0"),
    (lambda d: d["points"][4].pop("in_features"), r"points\[4\]\.in_features must be a positive int; got None"),
], ids=["format", "device", "no-points", "missing-point", "duplicate", "negative-ms", "nan-ms", "float-tokens",
        "no-in-features"])
def test_malformed_tables_are_refused_naming_the_file_and_field(tmp_path, change, match):
    path = tmp_path / "bad.json"
    data = synthetic_table().to_dict()
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^policy table {path}: {match}"):
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
    assert d.fp8 and d.name == "fc" and d.source == "policy_nvidia_h200.json: measured"
    assert not P.decide(16, 16, 16, device="NVIDIA H200").fp8
    everything = P.decide(16, 16, 16, policy="all")  # no table consulted
    assert everything.fp8 and everything.reason == "policy='all'" and everything.fp8_ms is None
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
    is shipped until one has been measured on that GPU)."""
    for path in P.shipped_tables():
        table = P.PolicyTable.load(path)
        assert path.name == P.table_file_name(table.device)
        assert table.meta.get("clock") == "CUDA events" and not table.meta.get("smoke_test")
        assert not table.meta.get("synthetic")


def test_synthetic_grid_covers_both_decisions():
    pts = synthetic_points()
    assert {fp8_wins(p["tokens"], p["in_features"], p["out_features"]) for p in pts} == {True, False}
