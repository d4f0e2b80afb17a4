"""horovod_topk.core.costmodel and ``python -m horovod_topk.advise``: the predicted bytes are core.exchange's and the
routes core.policy's (the compressor's own decisions), the times follow the model the docstring states, and bad
input ends in a one-line error (exit code 2), not a traceback."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_topk import advise
from horovod_topk.core import TopKConfig
from horovod_topk.core.costmodel import Link, comm_time, predict, route_tensors, step_time
from horovod_topk.core.exchange import (
    ALLGATHER,
    AUTO,
    DENSE,
    SPARSE_ALLREDUCE,
    allgather_exchange_nbytes,
    choose_exchange,
    dense_nbytes,
    sparse_allreduce_nbytes,
)
from horovod_topk.core.policy import tensor_payload_layout

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("fixtures") / "bench_e2e_example.json"
IDEAL_1G = Link(1e9, efficiency=1.0, latency_s=1e-3)  # hand-computable: nominal rate, 1 ms per collective


# ---- bytes and routes come from core -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 16, 64])
def test_dense_and_fp16_bytes_are_dense_nbytes(world_size):
    tensors = advise.resnet50()
    dense = predict("dense", tensors, world_size, IDEAL_1G, 0.1)
    fp16 = predict("fp16", tensors, world_size, IDEAL_1G, 0.1)
    assert dense.nbytes == pytest.approx(sum(dense_nbytes(world_size, n, 4) for _, n in tensors))
    assert fp16.nbytes == pytest.approx(sum(dense_nbytes(world_size, n, 2) for _, n in tensors))
    assert {r.route for r in dense.routes} == {DENSE}


@pytest.mark.parametrize("world_size", [2, 3, 8, 64, 1024])
@pytest.mark.parametrize("ratio", [0.1, 0.01, 0.001])
def test_auto_choice_and_bytes_are_choose_exchange(world_size, ratio):
    config = TopKConfig(ratio=ratio)
    for route in route_tensors("topk", advise.resnet50(), world_size, config=config):
        if route.numel < config.min_numel:
            assert route.route == DENSE and route.k is None
            assert route.nbytes == pytest.approx(dense_nbytes(world_size, route.numel, 4))
            continue
        k = max(1, math.ceil(ratio * route.numel - 1e-9))
        best, cost = choose_exchange(AUTO, world_size, route.numel, k, 4, 4)
        assert route.route == best, route
        assert route.nbytes == pytest.approx(cost), route


def test_without_the_sparse_allreduce_auto_uses_the_allgather():
    routes = route_tensors("topk", advise.resnet50(), 64, config=TopKConfig(), sparse_available=False)
    assert SPARSE_ALLREDUCE not in {r.route for r in routes}
    assert ALLGATHER in {r.route for r in routes}


def test_compact_encoding_bytes_are_its_payload_layout():
    config = TopKConfig(index_bits=16, value_dtype="float8")
    numel = 1_000_000
    (route,) = route_tensors("topk", [("w", numel)], 4, config=config)
    assert route.route == ALLGATHER and route.k == 10_000
    assert route.nbytes == 3 * tensor_payload_layout(config, 10_000, numel, 1).nbytes
    assert route.nbytes < allgather_exchange_nbytes(4, 10_000, 4) / 2


def test_min_numel_tensors_stay_dense_and_value_dtype_counts():
    routes = route_tensors("topk", [("bias", 1000), ("w", 100_000)], 2,
                           config=TopKConfig(value_dtype="float16"))
    assert routes[0].route == DENSE and "min_numel" in routes[0].reason
    assert routes[1].route == ALLGATHER and routes[1].nbytes == allgather_exchange_nbytes(2, 1000, 2)


# ---- time arithmetic, by hand --------------------------------------------------------------------------------------


def test_small_case_matches_hand_computation():
    tensors = [("w", 1_000_000)]
    # dense: ring allreduce 2 (P-1)/P N 4 = 4e6 bytes -> 32 ms at 1 Gbit/s, + 1 ms for one collective.
    dense = predict("dense", tensors, 2, IDEAL_1G, 0.010)
    assert dense.nbytes == 4e6 and dense.collectives == 1
    assert dense.t_comm_s == pytest.approx(0.033) and dense.t_step_s == pytest.approx(0.043)
    assert dense.efficiency == pytest.approx(0.010 / 0.043)
    # allgather: k = 10,000 entries of 4 + 4 bytes, sent to the one other rank: 80,000 bytes -> 0.64 ms + 1 ms.
    ag = predict("topk", tensors, 2, IDEAL_1G, 0.010, config=TopKConfig(exchange=ALLGATHER))
    assert ag.nbytes == 80_000 and ag.collectives == 1
    assert ag.t_step_s == pytest.approx(0.010 + 0.00064 + 0.001)
    # sparse allreduce at P = 2: capacity min(ceil(1.1 * 5000), floor(2.2 * 5000) - 5000) = 5500 and 5000 kept,
    # 8 bytes each -> 84,000 bytes, two collectives.
    sa = predict("topk", tensors, 2, IDEAL_1G, 0.010, config=TopKConfig(exchange=SPARSE_ALLREDUCE))
    assert sa.nbytes == 84_000 == sparse_allreduce_nbytes(2, 10_000, 4) and sa.collectives == 2
    assert sa.t_step_s == pytest.approx(0.010 + 84_000 * 8 / 1e9 + 0.002)
    # auto takes the cheaper allgather at P = 2.
    auto = predict("topk", tensors, 2, IDEAL_1G, 0.010)
    assert [r.route for r in auto.routes] == [ALLGATHER] and auto.t_step_s == ag.t_step_s


def test_efficiency_constant_scales_bandwidth():
    assert comm_time(1e6, 0, Link(1e8, efficiency=0.5)) == pytest.approx(0.16)
    assert comm_time(1e6, 3, Link(1e8, efficiency=1.0, latency_s=0.01)) == pytest.approx(0.11)


def test_overlap_hides_at_most_the_communication():
    assert step_time(0.100, 0.050) == pytest.approx(0.150)
    assert step_time(0.100, 0.050, overlap=0.2) == pytest.approx(0.130)
    assert step_time(0.100, 0.050, overlap=1.0) == pytest.approx(0.100)  # all of it hidden, never less
    assert step_time(0.100, 0.050, t_compress_s=0.01) == pytest.approx(0.160)
    with pytest.raises(ValueError, match="overlap"):
        step_time(0.1, 0.1, overlap=1.5)


def test_compress_time_counts_for_topk_only():
    tensors = [("w", 1_000_000)]
    assert predict("dense", tensors, 2, IDEAL_1G, 0.01, t_compress_s=0.005).t_compress_s == 0.0
    topk = predict("topk", tensors, 2, IDEAL_1G, 0.01, t_compress_s=0.005)
    assert topk.t_step_s == pytest.approx(0.01 + 0.005 + topk.t_comm_s)


def test_one_worker_sends_nothing():
    for method in ("dense", "fp16", "topk"):
        pred = predict(method, advise.mlp_e2e(), 1, IDEAL_1G, 0.02)
        assert pred.nbytes == 0 and pred.collectives == 0 and pred.t_step_s == 0.02


def test_collectives_fused_dense_and_per_compressed_tensor():
    # 4 weights and the two 1024-element biases are compressed; the 512- and 10-element biases (< min_numel=1024)
    # go dense in one fused allreduce.
    tensors = advise.mlp_e2e()
    assert predict("dense", tensors, 2, IDEAL_1G, 0.0).collectives == 1
    assert predict("dense", tensors, 2, Link(1e9, fusion_threshold_bytes=1 << 20), 0.0).collectives == 9
    assert predict("dense", tensors, 2, Link(1e9, fusion_threshold_bytes=0), 0.0).collectives == 8
    assert predict("topk", tensors, 2, IDEAL_1G, 0.0, config=TopKConfig(exchange=ALLGATHER)).collectives == 1 + 6
    assert predict("topk", tensors, 4, IDEAL_1G, 0.0,
                   config=TopKConfig(exchange=SPARSE_ALLREDUCE)).collectives == 1 + 2 * 6


# ---- models and parsing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, count, total", [("resnet50", 161, 25_557_032), ("gpt2-small", 148, 124_439_808),
                                                ("bert-large", 391, 335_141_888), ("mlp-e2e", 8, 2_104_842)])
def test_presets_have_the_published_parameter_counts(name, count, total):
    tensors = advise.MODELS[name]()
    assert len(tensors) == count and sum(n for _, n in tensors) == total
    assert len({t for t, _ in tensors}) == count  # names are unique


def test_split_params_sums_exactly():
    tensors = advise.split_params(25_600_000)
    assert sum(n for _, n in tensors) == 25_600_000 and max(n for _, n in tensors) <= advise.LAYER_NUMEL
    assert advise.split_params(10, 4) == [("layer0", 4), ("layer1", 3), ("layer2", 3)]


@pytest.mark.parametrize("text, bps", [("10gbit", 1e10), ("100mbit", 1e8), ("1.5Gbit/s", 1.5e9), ("2.5e9", 2.5e9),
                                       ("64kbit", 64e3)])
def test_parse_bandwidth(text, bps):
    assert advise.parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["fast", "10mbps", "0gbit", "-1gbit", ""])
def test_parse_bandwidth_refuses(text):
    with pytest.raises(Exception, match="bandwidth"):
        advise.parse_bandwidth(text)


@pytest.mark.parametrize("text, seconds", [("120ms", 0.12), ("0.12s", 0.12), ("50us", 5e-5), ("1e3ns", 1e-6)])
def test_parse_duration(text, seconds):
    assert advise.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["120", "soon", "5 min"])
def test_parse_duration_wants_a_unit(text):
    with pytest.raises(Exception, match="unit"):
        advise.parse_duration(text)


def test_row_method_names():
    base = TopKConfig()
    assert advise.row_method({"method": "dense"}, base) == ("dense", base)
    method, cfg = advise.row_method({"method": "topk0.01-sparse_allreduce"}, base)
    assert method == "topk" and cfg.ratio == 0.01 and cfg.exchange == SPARSE_ALLREDUCE
    method, cfg = advise.row_method({"method": "topk0.001", "ratio": 0.001, "exchange": None}, base)
    assert cfg.ratio == 0.001 and cfg.exchange == AUTO
    with pytest.raises(ValueError, match="'sgd'"):
        advise.row_method({"method": "sgd"}, base)
    with pytest.raises(ValueError, match="'ring'"):
        advise.row_method({"method": "topk0.01-ring"}, base)


def test_check_on_the_fixture_predicts_from_each_rows_compute():
    data = json.loads(FIXTURE.read_text())
    lines = advise.check(data, Link(1.0), TopKConfig(), overlap=0.0, t_compress_s=0.0, sparse_available=True)
    rows = [line for line in lines if line.lstrip().startswith("2 ")]
    assert len(rows) == len(data["rows"]) == 12
    dense_100 = next(r for r in rows if "100mbit" in r and " dense " in r)
    # 17.3 ms + 8,419,368 bytes * 8 / (0.75 * 1e8) = 915.4 ms against 1041.1 measured: 0.88; bytes 8.419 / 8.444 MB.
    assert "915.4" in dense_100 and "0.88" in dense_100 and "8.419 MB" in dense_100 and "1.00" in dense_100
    assert lines[-1].startswith("step time predicted/measured over 12 rows")


def test_check_names_what_is_wrong():
    with pytest.raises(ValueError, match="tensors"):
        advise.check({"rows": []}, Link(1.0), TopKConfig(), overlap=0, t_compress_s=0, sparse_available=True)
    bad = {"tensors": [["w", 100]], "rows": [{"workers": 2, "rate": "100mbit", "method": "dense",
                                              "t_step_s": 0.1}]}
    with pytest.raises(ValueError, match="row 0.*t_compute_s"):
        advise.check(bad, Link(1.0), TopKConfig(), overlap=0, t_compress_s=0, sparse_available=True)


# ---- the command line ----------------------------------------------------------------------------------------------


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "horovod_topk.advise", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_cli_prints_every_method():
    out = run_cli("--model", "resnet50", "--workers", "16", "--bandwidth", "10gbit", "--compute", "120ms")
    assert out.returncode == 0, out.stderr
    for name in ("dense allreduce", "fp16 (Horovod)", "TopKEF 0.01 allgather", "TopKEF 0.01 sparse_allreduce",
                 "TopKEF 0.01 auto", "auto sends", "pays:"):
        assert name in out.stdout
    # dense bytes of ResNet-50 at P = 16: 2 * 15/16 * 25,557,032 * 4 = 191.678 MB
    assert "191.678 MB" in out.stdout


def test_cli_check_prints_ratios():
    out = run_cli("--check", str(FIXTURE))
    assert out.returncode == 0, out.stderr
    assert "pred/meas" in out.stdout and "geometric mean" in out.stdout
    assert out.stdout.count("topk0.01") == 3


@pytest.mark.parametrize("args, needle", [
    (["--model", "resnet50", "--workers", "0", "--bandwidth", "1gbit", "--compute", "1ms"], "--workers"),
    (["--model", "resnet50", "--workers", "2", "--bandwidth", "fast", "--compute", "1ms"], "--bandwidth"),
    (["--model", "resnet50", "--workers", "2", "--bandwidth", "1gbit", "--compute", "10"], "--compute"),
    (["--model", "resnet50", "--workers", "2", "--bandwidth", "1gbit"], "missing --compute"),
    (["--workers", "2", "--bandwidth", "1gbit", "--compute", "1ms"], "--model, --params or --tensors"),
    (["--params", "1e6", "--workers", "2", "--bandwidth", "1gbit", "--compute", "1ms", "--ratio", "2"], "--ratio"),
    (["--check", "/nonexistent/e2e.json"], "--check"),
])
def test_cli_bad_input_is_a_clear_error(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_cli_bad_check_file_is_a_clear_error(tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"tensors": [["w", 100]], "rows": [{"workers": 2, "rate": "warp", "method": "dense",
                                                                    "t_compute_s": 0.01, "t_step_s": 0.1}]}))
    out = run_cli("--check", str(path))
    assert out.returncode == 2 and "row 0" in out.stderr and "warp" in out.stderr and "Traceback" not in out.stderr
    path.write_text("{not json")
    out = run_cli("--check", str(path))
    assert out.returncode == 2 and "not JSON" in out.stderr and "Traceback" not in out.stderr


def test_advise_loads_no_framework():
    code = ("import sys, horovod_topk.advise\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorflow', 'numpy', 'horovod'))))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.strip()
    assert out == ""


def test_latency_makes_auto_pick_the_fastest_predicted_exchange(capsys):
    """With a link's latency, advise sets collective_latency_bytes = latency x effective rate: auto's per-tensor
    choice then minimises the model's own T_comm, so auto is never predicted slower than either forced exchange."""
    from horovod_topk.core.costmodel import latency_bytes

    link = Link(10e9, latency_s=50e-6)
    assert latency_bytes(link) == round(50e-6 * 0.75 * 10e9 / 8) == 46875
    tensors = advise.resnet50()
    cfg = TopKConfig(collective_latency_bytes=latency_bytes(link))
    times = {e: predict("topk", tensors, 32, link, 0.12, config=TopKConfig(**{**cfg.to_dict(), "exchange": e})).t_step_s
             for e in ("auto", "allgather", "sparse_allreduce")}
    assert times["auto"] <= min(times["allgather"], times["sparse_allreduce"])
    routes = {r.route for r in predict("topk", tensors, 32, link, 0.12, config=cfg).routes}
    assert routes == {"dense", "allgather", "sparse_allreduce"}  # a mix: neither exchange wins every tensor
    assert advise.main(["--model", "resnet50", "--workers", "32", "--bandwidth", "10gbit", "--compute", "120ms",
                        "--latency", "50us"]) == 0
    assert "pass TopKEF(collective_latency_bytes=46875)" in capsys.readouterr().out
    assert advise.main(["--model", "resnet50", "--workers", "32", "--bandwidth", "10gbit", "--compute", "120ms"]) == 0
    assert "131,072 bytes (TopKEF's default)" in capsys.readouterr().out


def test_auto_through_the_sparse_allreduce_says_what_it_costs_in_convergence(capsys):
    """When auto sends tensors through the sparse allreduce, advise says it applies fewer entries than the
    allgather and what ratio spends the allgather's bytes; both frameworks have the exchange."""
    for framework in ("torch", "tensorflow"):
        assert advise.main(["--model", "resnet50", "--workers", "32", "--bandwidth", "10gbit", "--compute", "120ms",
                            "--framework", framework]) == 0
        out = capsys.readouterr().out
        assert "not in TensorFlow" not in out
        assert "take the sparse allreduce: it applies at most k entries per step, the allgather up to 32k" in out
        assert "ratio=0.145 (x14.5, raising every compressed tensor's bytes) gives them the allgather's bytes" in out
    # at P = 2 auto never takes it, and nothing is said
    assert advise.main(["--model", "resnet50", "--workers", "2", "--bandwidth", "10gbit", "--compute", "120ms"]) == 0
    assert "sparse allreduce:" not in capsys.readouterr().out
    assert "about 3.6x the entries" in advise.sparse_allreduce_note(5, 8, None) and "ratio=" not in advise.sparse_allreduce_note(5, 8, None)
    capped = advise.sparse_allreduce_note(5, 32, 0.1)  # never a ratio above 1
    assert "ratio=1 (x10.0" in capped and "is the largest ratio and comes closest to" in capped


def test_check_predicts_an_auto_row_as_the_density_it_chose_and_compares_what_auto_measured():
    data = {"model": "m", "tensors": [["w", 1_000_000], ["b", 1000]], "grad_bytes": 4, "rows": [
        {"workers": 2, "rate": "1gbit", "rate_bps": 1e9, "method": "auto", "t_compute_s": 0.02, "t_step_s": 0.04,
         "tx_bytes_per_step": 1.7e5,
         "auto": {"ratio": 0.01, "predicted_s": {"0.01": 0.035, "dense": 0.05}, "bandwidth_bps": 8e8,
                  "latency_s": 0.001}},
        {"workers": 2, "rate": "1gbit", "rate_bps": 1e9, "method": "auto", "t_compute_s": 0.02, "t_step_s": 0.05,
         "auto": {"ratio": None, "predicted_s": {"dense": 0.05}, "bandwidth_bps": 8e8, "latency_s": 0.001}},
        {"workers": 2, "rate": "1gbit", "rate_bps": 1e9, "method": "auto", "t_compute_s": 0.02, "t_step_s": 0.045,
         "auto": {"ratio": "fp16", "predicted_s": {"dense": 0.05, "fp16": 0.044}, "bandwidth_bps": 8e8,
                  "latency_s": 0.001}},
    ]}
    lines = advise.check(data, Link(1.0, 0.75, 0.0), TopKConfig(), overlap=0.0, t_compress_s=0.0,
                         sparse_available=True)
    text = "\n".join(lines)
    sparse = predict("topk", [("w", 1_000_000), ("b", 1000)], 2, Link(1e9, 0.75), 0.02,
                     config=TopKConfig(ratio=0.01))
    dense = predict("dense", [("w", 1_000_000), ("b", 1000)], 2, Link(1e9, 0.75), 0.02)
    assert f"{sparse.t_step_s * 1e3:.1f}" in lines[2] and f"{dense.t_step_s * 1e3:.1f}" in lines[4]
    assert "auto chose 0.01; probed 800 Mbit/s = 0.80 x nominal" in text
    assert "its prediction 35.0 ms vs measured 40.0 ms (0.88)" in text
    assert "auto chose dense" in text
    half = predict("fp16", [("w", 1_000_000), ("b", 1000)], 2, Link(1e9, 0.75), 0.02)
    assert f"{half.t_step_s * 1e3:.1f}" in lines[6], lines  # an fp16 choice is predicted as fp16
    assert "auto chose fp16" in text and "its prediction 44.0 ms vs measured 45.0 ms" in text
