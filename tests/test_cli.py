"""``python -m fusedfp8 info | demo | bench`` on the CPU, ``ScalingState.summary`` and the
``fusedfp8`` logger, and the messages a newcomer gets (no CuPy, no FP8 GPU, NVRTC failure).

The commands run as subprocesses (``python -m fusedfp8 ...`` from the repository root), as a
user would run them.
"""
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import fusedfp8
from fusedfp8 import __main__ as cli
from fusedfp8 import _cuda
from _markers import gpu_ok

REPO = Path(__file__).resolve().parent.parent
TINY = ["--hidden", "32", "--ffn", "64", "--tokens", "48"]


def run_cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "fusedfp8", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


# ---- info ------------------------------------------------------------------------------------
def test_info_reports_versions_probe_and_cache():
    ok, reason = _cuda.probe()
    r = run_cli("info") if ok else run_cli("info", "--compile")  # with a GPU --compile would build everything
    assert r.returncode == (0 if ok else 1), r.stderr
    for want in ("fusedfp8", "python", "torch", "jax", "cupy", "GPU", "fused kernels", "FP8 GEMMs",
                 "kernel sources", "kernel cache", reason):
        assert want in r.stdout, (want, r.stdout)
    assert ("usable: " if ok else "not usable: ") + reason in r.stdout
    if not ok:
        assert "--compile needs a usable GPU" in r.stdout


# ---- demo ------------------------------------------------------------------------------------
def test_demo_tiny_writes_table_json_and_png(tmp_path):
    out = tmp_path / "demo"
    r = run_cli("demo", "--device", "cpu", "--steps", "4", *TINY, "--amax-history-len", "16", "--out", str(out))
    assert r.returncode == 0, r.stderr
    # the summary table, on stdout and in demo_summary.md
    for text in (r.stdout, (out / "demo_summary.md").read_text()):
        assert "| model | step time (median) | speed-up vs bf16 |" in text
        assert "| bf16 |" in text and "| fp8 |" in text
        assert "amax_history_len=16" in text
        assert "fc2.grad_output" in text  # the ScalingState.summary table
    assert "step" in r.stderr  # the tqdm bar
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    data = json.loads((out / "demo.json").read_text())
    assert data["device"] == "cpu" and data["shape"] == [32, 64, 48]
    assert data["config"]["recipe"]["amax_history_len"] == 16
    bf16, f8 = data["curves"]["bf16"], data["curves"]["fp8"]
    assert len(bf16["loss"]) == len(f8["loss"]) == 4 and np.all(np.isfinite(f8["loss"]))
    assert f8["tensors"] == [f"fc{i}.{r}" for i in (1, 2) for r in ("input", "weight", "grad_output")]
    scale = np.array(f8["scale"])
    amax = np.array(f8["amax"], dtype=float)
    assert scale.shape == amax.shape == (4, 6)
    # the update ran every step: scale = fmt_max / max(history) with 'max' over a 16-row history
    fmt_max = np.array([448, 448, 57344] * 2, np.float32)
    np.testing.assert_allclose(scale[-1], fmt_max / amax.max(axis=0), rtol=1e-6)
    assert f8["overflows"] == [0] * 6
    assert bf16["tensors"] == [] and bf16["amax"] is None


def test_demo_loss_tracks_bf16_on_cpu(tmp_path):
    """The default CPU width (64/256), 256 tokens, 20 steps: FP8 (emulated) learns as bf16 does."""
    from fusedfp8.demo import DemoConfig, run_demo

    res = run_demo(DemoConfig(device="cpu", tokens=256, steps=20, out=str(tmp_path), plot=False, progress=False),
                   echo=None)
    b, f = res.curves["bf16"], res.curves["fp8"]
    assert b.loss[-1] < 0.75 * b.loss[0]  # it trains
    assert abs(f.tail_loss() / b.tail_loss() - 1) < 0.05
    assert "png" not in res.files and Path(res.files["summary"]).is_file()


# error paths run in-process (cli.main), which is what the subprocess would run
@pytest.mark.parametrize("args, rc, message", [
    (["--amax-history-len", "0"], 2, "amax_history_len must be >= 1"),
    (["--fp8-format", "e5m2"], 2, "invalid choice: 'e5m2'"),
    (["--steps", "0"], 2, "steps must be an int >= 1"),
    (["--hidden", "-4"], 2, "hidden must be an int >= 1"),
], ids=["history-len", "format", "steps", "hidden"])
def test_demo_bad_flags_name_the_field(args, rc, message, capsys, tmp_path):
    try:
        got = cli.main(["demo", *args, "--out", str(tmp_path)])
    except SystemExit as e:  # argparse's own choices check
        got = e.code
    assert got == rc
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.skipif(gpu_ok, reason="this machine has a usable GPU")
def test_demo_cuda_without_usable_gpu_says_why(capsys, tmp_path):
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--device cuda" in err and _cuda.probe(0, need_fp8_gemm=True)[1] in err


def test_demo_jax_tiny_writes_table_json_and_png(capsys, tmp_path):
    """--framework jax at the tiny shape: the same table, files and per-step FP8 trace as torch."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = tmp_path / "demo"
    assert cli.main(["demo", "--framework", "jax", "--device", "cpu", "--steps", "4", *TINY, "--amax-history-len", "16",
                     "--no-progress", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    for text in (stdout, (out / "demo_summary.md").read_text()):
        assert "| model | step time (median) | speed-up vs bf16 |" in text
        assert "| bf16 |" in text and "| fp8 |" in text
        assert "jax, cpu" in text and "amax_history_len=16" in text
        assert "fc2.grad_output" in text  # the ScalingState.summary table
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    data = json.loads((out / "demo.json").read_text())
    assert data["config"]["framework"] == "jax" and data["device"] == "cpu" and data["shape"] == [32, 64, 48]
    assert "flax" in data["meta"] and "optax" in data["meta"]
    bf16, f8 = data["curves"]["bf16"], data["curves"]["fp8"]
    assert len(bf16["loss"]) == len(f8["loss"]) == 4 and np.all(np.isfinite(f8["loss"]))
    assert bf16["loss"][-1] < bf16["loss"][0] and f8["loss"][-1] < f8["loss"][0]  # both train
    assert abs(f8["loss"][0] / bf16["loss"][0] - 1) < 0.05  # same weights and data at step 1
    assert f8["tensors"] == [f"fc{i}.{r}" for i in (1, 2) for r in ("input", "weight", "grad_output")]
    scale, amax = np.array(f8["scale"]), np.array(f8["amax"], dtype=float)
    assert scale.shape == amax.shape == (4, 6) and np.all(amax > 0)
    # the scale after every step's update: fmt_max / max(history so far), 'max' over a 16-row history
    fmt_max = np.array([448, 448, 57344] * 2, np.float32)
    for i in range(4):
        np.testing.assert_allclose(scale[i], fmt_max / amax[:i + 1].max(axis=0), rtol=1e-6)
    assert f8["overflows"] == [0] * 6
    assert bf16["tensors"] == [] and bf16["amax"] is None


def test_demo_help_explains_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--hidden", "--ffn", "--tokens", "--margin", "--amax-history-len", "--amax-compute-algo",
                 "--fp8-format", "--first-step", "--out", "--framework", "--device", "--no-plot"):
        assert flag in out


# ---- bench -----------------------------------------------------------------------------------
def test_bench_dry_run_writes_summary(tmp_path):
    r = run_cli("bench", "--dry-run", "--tiny", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "summary.md").read_text()
    assert "## bench_kernels" in text and "## bench_mlp" in text
    assert "dry run" in text
    assert "bench_mlp.py --framework torch" in text and "not executed (--dry-run)" in text
    if not gpu_ok:
        assert "skipped: needs a GPU that runs the fused kernels" in text
    assert not (tmp_path / "bench_mlp.json").exists()


@pytest.mark.skipif(gpu_ok, reason="on a GPU --tiny runs the GPU benchmarks (the GPU runs cover it)")
def test_bench_tiny_on_cpu_runs_the_mlp_script(tmp_path):
    r = run_cli("bench", "--tiny", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (tmp_path / "summary.md").read_text()
    assert "bench_mlp: ok" in r.stdout or "ok," in text
    assert (tmp_path / "bench_mlp.json").is_file() and (tmp_path / "bench_mlp.png").is_file()
    assert "| 32/64/48 |" in text  # bench_mlp's markdown table, collected
    assert "![bench_mlp](bench_mlp.png)" in text


def test_bench_without_source_checkout_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "scripts_dir", lambda: None)
    assert cli.main(["bench", "--dry-run", "--out", str(tmp_path)]) == 2
    assert "run this from a source checkout" in capsys.readouterr().err


# ---- ScalingState.summary and the fusedfp8 logger --------------------------------------------
def test_summary_values_and_overflow_logging(caplog):
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    state = fusedfp8.ScalingState.create([False, True], recipe)
    x = np.array([[1.0, -3.5], [2.0, 0.5]], np.float32)
    nan = np.array([1.0, np.nan], np.float32)
    fusedfp8.quantize(x, state.slot(0, recipe))
    fusedfp8.quantize(nan, state.slot(1, recipe))
    state = fusedfp8.update_scales(state, recipe)
    with caplog.at_level(logging.WARNING, logger="fusedfp8"):
        text = state.summary(recipe, names=["x", "dy"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["tensor", "role", "format"]
    row_x, row_dy = lines[2].split(), lines[3].split()
    assert row_x[:3] == ["x", "forward", "e4m3"] and row_dy[:3] == ["dy", "gradient", "e5m2"]
    assert float(row_x[3]) == pytest.approx(448 / 3.5, rel=1e-3)  # scale
    assert row_x[-2:] == ["0", "1"] and row_dy[-2:] == ["1", "0"]  # overflows, updates
    warnings = [r for r in caplog.records if r.name == "fusedfp8"]
    assert len(warnings) == 1 and "tensor dy saw 1 new non-finite amax" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fusedfp8"):  # nothing new: nothing logged
        state.summary(recipe, names=["x", "dy"])
        assert not caplog.records
        fusedfp8.quantize(nan, state.slot(1, recipe))
        state = fusedfp8.update_scales(state, recipe)
        state.summary(recipe, names=["x", "dy"])
    assert len(caplog.records) == 1 and "1 new non-finite amax(es) (2 in total)" in caplog.records[0].getMessage()


def test_summary_torch_state_and_bad_names():
    torch = pytest.importorskip("torch")
    recipe = fusedfp8.DelayedScaling(amax_history_len=1)
    state = fusedfp8.ScalingState.create(2, recipe, like=torch.zeros(1))
    text = state.summary()
    assert len(text.splitlines()) == 4 and text.splitlines()[2].split()[:3] == ["0", "forward", "-"]
    with pytest.raises(ValueError, match="names: the state has 2 tensors; got 1 names"):
        state.summary(names=["a"])


# ---- newcomer errors ---------------------------------------------------------------------------
def test_gpu_array_without_cupy_says_install_cuda_extra(monkeypatch):
    monkeypatch.setattr(_cuda, "probe", lambda device_id=0, need_fp8_gemm=False:
                        (False, "CuPy is not installed (pip install 'fusedfp8[cuda]')"))
    with pytest.raises(RuntimeError, match=r"cannot run on cuda:0: CuPy is not installed \(pip install 'fusedfp8\[cuda\]'\)"):
        _cuda._build(_cuda.ModuleKey("update_scales"), 0)


def test_gpu_without_fp8_says_so(monkeypatch):
    monkeypatch.setattr(_cuda, "probe", lambda device_id=0, need_fp8_gemm=False:
                        (False, "GPU of compute capability 8.0 has no FP8 conversion instructions (needs 8.9 or newer)"))
    with pytest.raises(RuntimeError, match="compute capability 8.0 has no FP8 conversion instructions"):
        _cuda._build(_cuda.ModuleKey("quantize", "bfloat16", "e4m3", "identity"), 0)


def test_nvrtc_failure_names_kernels_options_and_log(monkeypatch):
    class CompileException(Exception):
        pass

    class RawModule:
        def __init__(self, code, options, name_expressions):
            raise CompileException("quantize.cu(12): error: identifier \"__nv_fp8_e4m3\" is undefined")

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(CompileException=CompileException))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_cuda, "probe", lambda device_id=0, need_fp8_gemm=False: (True, "fake GPU"))
    with pytest.raises(_cuda.CompileError) as e:
        _cuda._build(_cuda.ModuleKey("quantize", "bfloat16", "e4m3", "identity"), 0)
    msg = str(e.value)
    assert "NVRTC failed to compile quantize.cu" in msg
    assert "quantize_tiled<__nv_bfloat16, 0, 0>" in msg  # the kernel names
    assert "-DFF8_THREADS=256" in msg  # the options
    assert "identifier \"__nv_fp8_e4m3\" is undefined" in msg  # the log
