"""scripts/demo_report.py, the end of scripts/demo.sh: its table, and the advisor's block that says where TopKEF
pays (on made-up run summaries in the examples' --summary format)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIGITS = [288, 32, 18432, 64, 131072, 128, 1280, 10]  # the digits CNN's trainable tensors


def summary(path: Path, framework: str, ratio, step_s: float) -> None:
    history = [{"epoch": e, "loss": 1.0, "accuracy": 0.9, "train_s": step_s * 22, "steps": 22} for e in (1, 2, 3)]
    path.write_text(json.dumps({
        "framework": framework, "method": "dense allreduce" if ratio is None else f"TopKEF(ratio={ratio:g})",
        "history": history, "final_accuracy": 0.9, "bytes_sent": 40e6 if ratio is None else 0.9e6,
        "bytes_dense": 40e6, "wall_s": 10.0, "step_s": step_s, "ratio": ratio, "tensors": DIGITS}))


def report(directory: Path) -> list:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_report.py"), str(directory)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return out.rstrip().splitlines()


def test_the_last_lines_say_where_topkef_pays(tmp_path):
    summary(tmp_path / "1.json", "PyTorch", 0.01, 0.020)
    summary(tmp_path / "2.json", "PyTorch", None, 0.010)
    lines = report(tmp_path)
    assert (tmp_path / "demo.png").exists()
    assert any("loopback" in line for line in lines)
    assert lines[-2].strip().startswith("python -m horovod_topk.advise --tensors 288 32 18432")
    assert "--workers 8" in lines[-2] and "--compute 10.0ms" in lines[-2] and "--compress-time 10.0ms" in lines[-2]
    assert lines[-1].startswith("Where TopKEF pays for this model on 8 workers: PyTorch on links below ~")
    # the break-even it names is where the advisor's prediction turns: slower at 1 and 10 Gbit/s for this small model
    rows = [line for line in lines if "Gbit/s" in line and line.endswith("pay")]
    assert len(rows) == 2 and all("does not pay" in line for line in rows)


def test_without_a_pair_there_is_no_advisor_block(tmp_path):
    summary(tmp_path / "1.json", "PyTorch", 0.01, 0.020)
    lines = report(tmp_path)
    assert lines[-1].startswith("plot: ")
