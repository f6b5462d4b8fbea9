"""``python -m fusedfp8 info | demo | bench`` on the CPU, ``ScalingState.summary`` and the
``fusedfp8`` logger, and the messages a newcomer gets (no CuPy, no FP8 GPU, NVRTC failure).

The torch and the jax demo run as subprocesses (``python -m fusedfp8 demo ...``), as a user
would run them; the other commands run in this process through ``fusedfp8.__main__.main``,
which is what the subprocess would run (``bench --tiny`` still starts the benchmark script as a
process of its own). Shapes are tiny and runs short. The jax demo spends most of its time in
XLA compiling its FP8 step (10-20 s on a 2-core machine), so it starts in the background when
this file's first test runs and overlaps the others; its test collects it.
"""
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fusedfp8
from fusedfp8 import __main__ as cli
from fusedfp8 import launch
from fusedfp8.launch import kernels as K
from fusedfp8.demo import bench as demo_bench
from support.fake_cuda import fake_cupy

REPO = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--ffn", "64", "--tokens", "48"]
GPU_OK = launch.probe()[0]
FP8_GEMM_OK = launch.probe(need_fp8_gemm=True)[0]
ROLES = ("input", "weight", "grad_output")
FMT_MAX = np.array([448, 448, 57344] * 2, np.float32)  # hybrid: E4M3 input and weight, E5M2 gradient


def start_cli(*args, cwd=REPO) -> subprocess.Popen:
    """``python -m fusedfp8 *args`` in ``cwd``, importing this checkout's fusedfp8."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "fusedfp8", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)


def run_cli(*args, timeout=120, cwd=REPO) -> subprocess.CompletedProcess:
    proc = start_cli(*args, cwd=cwd)
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def check_png(path: Path, min_bytes: int = 10_000):
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > min_bytes


def check_demo_outputs(out: Path, stdout: str, framework: str, steps: int):
    """The table on stdout and in demo_summary.md, the PNG, and the JSON of a tiny demo run
    (--amax-history-len 16, 'max'): every step's scale is fmt_max / max(amaxes so far)."""
    for text in (stdout, (out / "demo_summary.md").read_text()):
        assert "| model | step time (median) | speed-up vs bf16 |" in text
        assert "| bf16 |" in text and "| fp8 |" in text
        assert f"{framework}, cpu" in text and "amax_history_len=16" in text
        assert "fc2.grad_output" in text  # the ScalingState.summary table
    assert stdout.rstrip().splitlines()[-1] == f"wrote demo_summary.md, demo.json, demo.png to {out.resolve()}/"
    check_png(out / "demo.png")
    data = json.loads((out / "demo.json").read_text())
    assert data["config"]["framework"] == framework and data["device"] == "cpu" and data["shape"] == [32, 64, 48]
    assert data["config"]["recipe"]["amax_history_len"] == 16
    bf16, f8 = data["curves"]["bf16"], data["curves"]["fp8"]
    assert len(bf16["loss"]) == len(f8["loss"]) == steps and np.all(np.isfinite(f8["loss"]))
    assert bf16["loss"][-1] < bf16["loss"][0] and f8["loss"][-1] < f8["loss"][0]  # both train
    assert abs(f8["loss"][0] / bf16["loss"][0] - 1) < 0.05  # same weights and data at step 1
    np.testing.assert_allclose(data["fp8_over_bf16_loss"], np.array(f8["loss"]) / np.array(bf16["loss"]), rtol=1e-6)
    assert f8["tensors"] == [f"fc{i}.{r}" for i in (1, 2) for r in ROLES]
    scale, amax = np.array(f8["scale"]), np.array(f8["amax"], dtype=float)
    assert scale.shape == amax.shape == (steps, 6) and np.all(amax > 0)
    for i in range(steps):  # the update ran every step
        np.testing.assert_allclose(scale[i], FMT_MAX / amax[:i + 1].max(axis=0), rtol=1e-6)
    assert f8["overflows"] == [0] * 6
    assert bf16["tensors"] == [] and bf16["amax"] is None and bf16["scale"] is None
    return data


@pytest.fixture(scope="module", autouse=True)
def jax_demo(request, tmp_path_factory):
    """(process, output folder) of the tiny jax demo, started in the background for this
    module when its test is selected and flax and optax are installed; None otherwise."""
    wanted = any(item.originalname == "test_demo_jax_tiny_writes_table_json_and_png" for item in request.session.items)
    if not wanted or any(importlib.util.find_spec(m) is None for m in ("flax", "optax")):
        yield None
        return
    out = tmp_path_factory.mktemp("jax_demo") / "demo"
    proc = start_cli("demo", "--framework", "jax", "--device", "cpu", "--steps", "4", *TINY, "--amax-history-len", "16",
                     "--no-progress", "--out", str(out))
    yield proc, out
    if proc.poll() is None:  # its test did not collect it (failed or deselected): stop it
        proc.kill()
        proc.communicate()


# ---- info ------------------------------------------------------------------------------------
def test_info_reports_versions_probe_and_cache(capsys):
    ok, reason = launch.probe()
    rc = cli.main(["info"]) if ok else cli.main(["info", "--compile"])  # with a GPU --compile would build everything
    assert rc == (0 if ok else 1)
    stdout = capsys.readouterr().out
    for want in ("fusedfp8", "python", "torch", "jax", "cupy", "GPU", "fused kernels", "FP8 GEMMs", "block FP8 GEMMs",
                 "kernel sources", "kernel cache", reason):
        assert want in stdout, (want, stdout)
    assert ("usable: " if ok else "not usable: ") + reason in stdout
    block_ok, block_reason = launch.probe(need_block_gemm=True)
    assert f"block FP8 GEMMs   {'usable' if block_ok else 'not usable'}: {block_reason}" in stdout
    if not ok:
        assert "--compile needs a usable GPU" in stdout


# ---- demo ------------------------------------------------------------------------------------
def test_demo_torch_tiny_writes_table_json_and_png(tmp_path):
    """The torch demo end to end, as a user runs it from some folder: --out relative to it."""
    r = run_cli("demo", "--device", "cpu", "--steps", "4", *TINY, "--amax-history-len", "16", "--out", "demo",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step" in r.stderr  # the tqdm bar
    data = check_demo_outputs(tmp_path / "demo", r.stdout, "torch", 4)
    assert data["meta"]["torch_threads"] == 1 and "torch" in data["meta"]


def test_demo_loss_tracks_bf16_on_cpu(tmp_path):
    """The default CPU width (64/256), 128 tokens, 20 steps: FP8 (emulated) learns as bf16 does."""
    from fusedfp8.demo import DemoConfig, run_demo

    res = run_demo(DemoConfig(device="cpu", tokens=128, steps=20, out=str(tmp_path), plot=False, progress=False),
                   echo=None)
    b, f = res.curves["bf16"], res.curves["fp8"]
    assert b.loss[-1] < 0.75 * b.loss[0]  # it trains
    assert abs(f.tail_loss() / b.tail_loss() - 1) < 0.05
    assert "png" not in res.files and Path(res.files["summary"]).is_file()


@pytest.mark.parametrize("tail_ratio, verdict", [(1.0125, "within"), (0.9875, "within"), (1.025, "outside"),
                                               (0.97, "outside")], ids=["within-above", "within-below",
                                                                        "outside-above", "outside-below"])
def test_demo_plot_draws_the_loss_check(tail_ratio, verdict):
    """The ratio panel shades the 2% band over the steps the loss check averages (the last
    LOSS_TAIL), not over the whole run, draws the ratio of the mean losses it compares with its
    verdict, and the notes say the same."""
    import matplotlib.pyplot as plt

    from fusedfp8.demo import LOSS_TAIL, Curve, DemoConfig
    from fusedfp8.demo.report import RATIO_BAND, DemoResult, figure

    steps = 30
    bf16 = np.linspace(1.0, 0.1, steps)
    fp8 = bf16 * np.where(np.arange(steps) >= steps - LOSS_TAIL, tail_ratio, 1.0 + 0.5 * (tail_ratio - 1))
    ms = np.ones(steps)
    curves = {"bf16": Curve(bf16, ms),
              "fp8": Curve(fp8, ms, ["fc1.input"], np.ones((steps, 1)), np.full((steps, 1), 448.0), np.zeros(1))}
    result = DemoResult(DemoConfig(device="cpu", steps=steps, progress=False), "cpu", "x86_64", "test",
                        (64, 256, 512), curves, {})
    assert any(f"{tail_ratio - 1:+.2%} of bf16's ({verdict} the 2% of the loss check)" in n for n in result.notes())
    fig = figure(result)
    try:
        ax = fig.axes[1]
        labels = ax.get_legend_handles_labels()[1]
        assert f"the loss check: FP8's mean loss of the last {LOSS_TAIL} steps within 2% of bf16's" in labels
        assert (f"FP8 / bf16 mean loss of the last {LOSS_TAIL} steps: {tail_ratio:.4f} ({tail_ratio - 1:+.2%}, "
                f"{verdict} the check)") in labels
        band, = ax.collections[:1]
        (x0, y0), (x1, y1) = band.get_paths()[0].get_extents().get_points()
        assert (x0, x1) == (steps - LOSS_TAIL + 0.5, steps + 0.5)
        assert (y0, y1) == pytest.approx((1 - RATIO_BAND, 1 + RATIO_BAND))
        tail_line = ax.collections[1].get_segments()[0]
        assert tail_line[:, 0].tolist() == [x0, x1] and tail_line[:, 1] == pytest.approx([tail_ratio] * 2)
        lo, hi = ax.get_ylim()
        assert lo < min(tail_ratio, 1.0) and hi > max(tail_ratio, 1.0)  # the check's mean is in view
    finally:
        plt.close(fig)


def test_demo_and_bench_write_to_a_folder_of_the_current_one_by_default():
    parser = cli.argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    cli._demo_parser(sub)
    cli._bench_parser(sub)
    assert parser.parse_args(["demo"]).out == "fusedfp8_demo"
    assert parser.parse_args(["bench"]).out == "fusedfp8_bench"
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "fusedfp8_demo/" in ignored and "fusedfp8_bench/" in ignored


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


@pytest.mark.skipif(FP8_GEMM_OK, reason="this machine has a GPU with FP8 GEMMs")
def test_demo_cuda_without_usable_gpu_says_why(capsys, tmp_path):
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--device cuda" in err and launch.probe(0, need_fp8_gemm=True)[1] in err


def test_demo_help_explains_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--hidden", "--ffn", "--tokens", "--margin", "--amax-history-len", "--amax-compute-algo",
                 "--fp8-format", "--first-step", "--out", "--framework", "--device", "--no-plot"):
        assert flag in out


def test_task_twins_share_parameter_names_with_the_fp8_mlps():
    """The bf16 twins of fusedfp8.demo.task load the same weights as Fp8MLP (torch and flax)."""
    import torch

    import fusedfp8.pytorch as fp8
    from fusedfp8.demo import task

    weights = task.torch_initial_weights(32, 64, seed=3)
    twin = task.torch_model("bf16", 32, 64, weights)
    f8 = task.torch_model("fp8", 32, 64, weights)
    assert isinstance(twin, task.TorchMLP) and isinstance(f8, fp8.Fp8MLP)
    for name, p in twin.named_parameters():
        assert torch.equal(p, dict(f8.named_parameters())[name]) and p.dtype == torch.bfloat16
    assert torch.equal(task.torch_initial_weights(32, 64, seed=3)["fc1.weight"], weights["fc1.weight"])
    x, y = task.Task(32, 48, seed=3).torch_batch(1)
    assert x.shape == y.shape == (48, 32) and x.dtype == torch.bfloat16
    assert not torch.equal(x, task.Task(32, 48, seed=3).torch_batch(2)[0])  # a fresh batch per step
    assert torch.equal(y, task.Task(32, 48, seed=3).torch_batch(1)[1])  # reproducible


# ---- bench -----------------------------------------------------------------------------------
def test_bench_dry_run_prints_every_command(capsys, tmp_path):
    tmp_path = tmp_path.resolve()
    assert cli.main(["bench", "--dry-run", "--tiny", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    text = (tmp_path / "summary.md").read_text()
    for name in ("bench_kernels", "bench_mlp_torch", "bench_mlp_jax"):
        assert f"## {name}" in text and f"scripts/{name}.py --out {tmp_path}" in text
        assert f"scripts/{name}.py --out {tmp_path}" in stdout  # skipped ones too
    assert "dry run" in text and "not executed (--dry-run)" in text
    if not FP8_GEMM_OK:
        assert "skipped: needs a GPU that runs the fused kernels" in text
        assert "bench_mlp_torch.py --out" in text and "--device cpu --shapes 32x64x48" in text
    assert stdout.rstrip().splitlines()[-1] == f"wrote summary.md to {tmp_path}/"
    assert not (tmp_path / "bench_mlp_torch.json").exists()


@pytest.mark.skipif(FP8_GEMM_OK, reason="on a GPU --tiny runs the GPU benchmarks (the GPU runs cover it)")
def test_bench_tiny_on_cpu_runs_the_mlp_script(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--tiny", "--only", "bench_mlp_torch", "--out", "bench"])
    stdout = capsys.readouterr().out
    out = tmp_path / "bench"
    assert rc == 0, stdout + (out / "bench_mlp_torch.log").read_text()
    text = (out / "summary.md").read_text()
    assert "bench_mlp_torch: ok" in stdout and "## bench_mlp_jax" not in text
    check_png(out / "bench_mlp_torch.png")
    data = json.loads((out / "bench_mlp_torch.json").read_text())
    assert data["meta"]["framework"] == "torch" and data["results"][0]["correctness"]["ok"]
    # both FP8 recipes in one run (--recipes delayed,current), each row saying its recipe
    res = data["results"][0]
    assert {m: r["recipe"] for m, r in res["modes"].items()} == {"bf16_eager": None, "fp8_eager": "delayed",
                                                                  "fp8_eager@current": "current"}
    assert set(data["meta"]["recipes"]) == {"delayed", "current"} and "CurrentScaling" in data["meta"]["recipe"]
    assert set(res["correctness"]) == {"sqnr_db", "sqnr_db@current", "ok"}
    assert min(res["correctness"]["sqnr_db@current"].values()) >= 20
    # the state machine: delayed advanced once per step (3), current never (updates 0, 2 history rows)
    assert res["modes"]["fp8_eager"]["fp8_state"] == {"recipe": "delayed", "history_rows": [1024], "updates": [3],
                                                      "expected_updates": 3, "ok": True}
    assert res["modes"]["fp8_eager@current"]["fp8_state"] == {"recipe": "current", "history_rows": [2],
                                                              "updates": [0], "expected_updates": 0, "ok": True}
    s, ms = res["summary"], {m: r["step_ms"] for m, r in res["modes"].items()}
    assert s["recipes"]["fp8_eager"]["current_vs_delayed"] == ms["fp8_eager"] / ms["fp8_eager@current"]
    assert s["recipes"]["fp8_eager"]["current_vs_bf16"] == ms["bf16_eager"] / ms["fp8_eager@current"]
    assert s["fp8_eager@current_loss_within_2pct"] is True and s["fp8_eager_loss_within_2pct"] is True
    assert s["best"]["fp8"] == "fp8_eager" and s["best@current"]["fp8"] == "fp8_eager@current"
    # no GPU busy time on the CPU: the profile's figures are null with the reason
    for row in res["modes"].values():
        assert row["profile"] == {"busy_ms_per_step": None, "span_ms_per_step": None, "kernels_per_step": None,
                                  "top_kernels": None, "idle_ms_per_step": None, "largest_gaps": None,
                                  "reason": "no GPU"} and row["wall_over_busy"] is None
    assert "GPU busy - (no GPU)" in (out / "bench_mlp_torch.log").read_text()
    assert "| 32/64/48 |" in text  # the script's markdown table, collected
    assert "fp8_eager@current" in text
    assert "![bench_mlp_torch](bench_mlp_torch.png)" in text
    assert stdout.rstrip().splitlines()[-1] == (f"wrote summary.md, bench_mlp_torch.log, bench_mlp_torch.json, "
                                                  f"bench_mlp_torch.png to {out.resolve()}/")


def test_bench_commands_on_a_gpu_machine(tmp_path):
    """What runs where (fusedfp8.demo.bench.bench_commands): on an FP8 GPU all three, tiny or
    full; the jax one skipped without jax's GPU backend; without a GPU only the CPU smoke tests."""
    scripts = REPO / "scripts"
    full = demo_bench.bench_commands(scripts, tmp_path, gpu=True, tiny=False)
    assert [(c.name, c.skip) for c in full] == [(n, "") for n in demo_bench.BENCHMARKS]
    assert all(c.argv[1:] == [str(scripts / f"{c.name}.py"), "--out", str(tmp_path)] for c in full)
    tiny = demo_bench.bench_commands(scripts, tmp_path, gpu=True, tiny=True, jax_gpu="jax has no GPU device")
    assert all("--device" not in c.argv and len(c.argv) > 4 for c in tiny)
    assert [bool(c.skip) for c in tiny] == [False, False, True] and "jax has no GPU device" in tiny[2].skip
    cpu = demo_bench.bench_commands(scripts, tmp_path, gpu=False, tiny=True)
    assert [bool(c.skip) for c in cpu] == [True, False, False]
    assert all(c.argv[c.argv.index("--device") + 1] == "cpu" for c in cpu[1:])


def test_bench_without_source_checkout_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo_bench, "scripts_dir", lambda: None)
    assert cli.main(["bench", "--dry-run", "--out", str(tmp_path)]) == 2
    assert "run this from a source checkout" in capsys.readouterr().err


def test_bench_only_names_a_benchmark(capsys, tmp_path):
    assert cli.main(["bench", "--only", "bench_mlp", "--out", str(tmp_path)]) == 2
    assert "--only: unknown ['bench_mlp']" in capsys.readouterr().err


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
    monkeypatch.setattr(K, "probe", lambda device_id=0, need_fp8_gemm=False:
                        (False, "CuPy is not installed (pip install 'fusedfp8[cuda]')"))
    with pytest.raises(RuntimeError, match=r"cannot run on cuda:0: CuPy is not installed \(pip install 'fusedfp8\[cuda\]'\)"):
        K._build(K.ModuleKey("update_scales"), 0)


def test_gpu_without_fp8_says_so(monkeypatch):
    monkeypatch.setattr(K, "probe", lambda device_id=0, need_fp8_gemm=False:
                        (False, "GPU of compute capability 8.0 has no FP8 conversion instructions (needs 8.9 or newer)"))
    with pytest.raises(RuntimeError, match="compute capability 8.0 has no FP8 conversion instructions"):
        K._build(K.ModuleKey("quantize", "bfloat16", "e4m3", "identity"), 0)


def test_nvrtc_failure_names_kernels_options_and_log(monkeypatch):
    class CompileException(Exception):
        pass

    class RawModule:
        def __init__(self, code, options, name_expressions):
            raise CompileException("quantize.cu(12): error: identifier \"__nv_fp8_e4m3\" is undefined")

    fake = fake_cupy(lambda expr: 1)
    fake.RawModule = RawModule
    fake.cuda.compiler.CompileException = CompileException
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(K, "probe", lambda device_id=0, need_fp8_gemm=False: (True, "fake GPU"))
    with pytest.raises(K.CompileError) as e:
        K._build(K.ModuleKey("quantize", "bfloat16", "e4m3", "identity"), 0)
    msg = str(e.value)
    assert "NVRTC failed to compile quantize.cu" in msg
    assert "quantize_tiled<__nv_bfloat16, 0, 0>" in msg  # the kernel names
    assert "-DFF8_THREADS=256" in msg  # the options
    assert "identifier \"__nv_fp8_e4m3\" is undefined" in msg  # the log


# ---- last: the jax demo started in the background (fixture jax_demo) -------------------------
def test_demo_jax_tiny_writes_table_json_and_png(jax_demo):
    """--framework jax at the tiny shape: the same table, files and per-step FP8 trace as torch."""
    if jax_demo is None:
        pytest.skip("needs flax and optax")
    proc, out = jax_demo
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    data = check_demo_outputs(out, stdout, "jax", 4)
    assert "flax" in data["meta"] and "optax" in data["meta"] and data["meta"]["jax_backend"] == "cpu"
