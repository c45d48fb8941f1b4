"""The concurrency sweep's parts: methods, CPU recipe, cell numbers, results folder, servers."""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from sweep_bench import (  # noqa: E402
    bench_argv,
    jsonl_prompts,
    parse_bench_args,
    short_prompts,
    write_bench_dataset,
)
from sweep_medians import cell_label, collect, load_runs, run_shares, summary_rows  # noqa: E402
from sweep_methods import (  # noqa: E402
    CPU_STANDINS,
    largest_window,
    parse_methods,
    pool_tokens,
    server_setup,
    trace_env,
)
from sweep_metrics import cell_metrics  # noqa: E402
from sweep_report import ResultStore, folder_name, write_reports  # noqa: E402
from sweep_server import (  # noqa: E402
    LOWEST_PORT,
    ephemeral_ports_start,
    free_port,
    group_alive,
    running_server,
    stop_group,
    warm_up,
)

DRAFTER = Path("/models/drafter")


def option(args: list[str], flag: str) -> str:
    """The value following ``flag`` in a launcher command line."""
    return args[args.index(flag) + 1]


def bench_result(**overrides: float) -> dict:
    """A bench_serving result dict with every key a cell reads."""
    result = {
        "output_throughput": 100.0, "request_throughput": 2.0, "completed": 8,
        "total_output_tokens": 512, "duration": 4.0, "accept_length": 2.5,
        "mean_ttft_ms": 10.0, "median_ttft_ms": 9.0, "p99_ttft_ms": 20.0,
        "mean_itl_ms": 5.0, "median_itl_ms": 4.0, "p99_itl_ms": 8.0,
    }  # fmt: skip
    return result | overrides


def info(bastion: dict | None = None, num_draft_tokens: int | None = 16) -> dict:
    """A /server_info reply with the scheduler state the sweep reads."""
    state = {} if bastion is None else {"bastion": bastion}
    return {"speculative_num_draft_tokens": num_draft_tokens, "internal_states": [state]}


def test_bastion_fixed_methods_set_their_tree_size_and_fixed_mode() -> None:
    (method,) = parse_methods(["bastion-32"], DRAFTER)
    assert option(method.args, "--speculative-algorithm") == "BASTION"
    assert option(method.args, "--speculative-num-draft-tokens") == "32"
    assert option(method.args, "--speculative-draft-model-path") == str(DRAFTER)
    assert method.env == {"SGLANG_BASTION_MODE": "fixed"}


def test_adaptive_method_points_the_worker_at_the_profile_with_the_largest_fixed_n() -> None:
    methods = parse_methods(
        ["bastion-16", "bastion-64", "bastion-adaptive"], DRAFTER, None, Path("p.json")
    )
    adaptive = methods[-1]
    assert adaptive.env == {"SGLANG_BASTION_PROFILE": "p.json"}  # the worker's adaptive default
    assert option(adaptive.args, "--speculative-num-draft-tokens") == "64"


def test_adaptive_method_may_name_the_controller_mode() -> None:
    (adaptive,) = parse_methods(["bastion-adaptive"], DRAFTER, None, Path("p.json"), None, "ema")
    assert adaptive.env["SGLANG_BASTION_MODE"] == "ema"


def test_an_adaptive_method_suffix_names_its_own_mode_beside_the_default() -> None:
    names = ["bastion-adaptive", "bastion-adaptive-ema_calib", "bastion-adaptive-static"]
    default, ema_calib, static = parse_methods(names, DRAFTER, None, Path("p.json"))
    assert "SGLANG_BASTION_MODE" not in default.env
    assert ema_calib.env["SGLANG_BASTION_MODE"] == "ema_calib"
    assert static.env["SGLANG_BASTION_MODE"] == "static"


def test_the_uniform_method_is_the_adaptive_controller_with_one_width_per_batch() -> None:
    adaptive, uniform = parse_methods(
        ["bastion-adaptive", "bastion-uniform"], DRAFTER, None, Path("p.json")
    )
    assert uniform.env == {**adaptive.env, "SGLANG_BASTION_LAYOUT": "uniform"}
    assert uniform.args == adaptive.args


def test_the_surrogate_method_is_the_adaptive_controller_that_does_not_learn() -> None:
    adaptive, surrogate = parse_methods(
        ["bastion-adaptive", "bastion-surrogate"], DRAFTER, None, Path("p.json")
    )
    assert "SGLANG_BASTION_LEARN_ACCEPTANCE" not in adaptive.env
    assert surrogate.env == {**adaptive.env, "SGLANG_BASTION_LEARN_ACCEPTANCE": "0"}
    assert surrogate.args == adaptive.args


def test_a_sync_suffix_runs_any_method_on_the_synchronous_schedule() -> None:
    names = ["none", "none-sync", "bastion-8-sync", "bastion-adaptive", "bastion-adaptive-sync"]
    none, none_sync, fixed_sync, adaptive, adaptive_sync = parse_methods(
        names, DRAFTER, None, Path("p.json")
    )
    assert none_sync.args == [*none.args, "--disable-overlap-schedule"]
    assert adaptive_sync.args == [*adaptive.args, "--disable-overlap-schedule"]
    assert adaptive_sync.env == adaptive.env and adaptive_sync.algorithm == "BASTION"
    assert option(fixed_sync.args, "--speculative-num-draft-tokens") == "8"
    assert "--disable-overlap-schedule" not in adaptive.args
    assert [m.name for m in (none_sync, adaptive_sync)] == ["none-sync", "bastion-adaptive-sync"]


def test_medians_compare_each_setup_with_itself_on_the_synchronous_schedule(
    tmp_path: Path,
) -> None:
    sync = ["--disable-overlap-schedule"]
    cells = [
        {"method": "none", "concurrency": 4, "output_tok_s": 300.0, "itl_p50_ms": 10.0},
        {"method": "none-sync", "concurrency": 4, "output_tok_s": 250.0, "itl_p50_ms": 12.0,
         "server": {"args": sync}},
        adaptive_cell(4, 330.0, 32, overhead=False),
        adaptive_cell(4, 300.0, 32, overhead=False) | {"method": "bastion-adaptive-sync"},
    ]  # fmt: skip
    cells[3]["server"]["args"] = [*cells[3]["server"]["args"], *sync]
    rows = {r["setup"]: r for r in summary_rows(*collect(load_runs([write_run(tmp_path, cells)])))}
    assert set(rows) == {"none", "none sync", "adaptive N_max=32", "adaptive N_max=32 sync"}
    assert rows["none"]["of_sync"] == pytest.approx(300 / 250)
    assert rows["adaptive N_max=32"]["of_sync"] == pytest.approx(330 / 300)
    assert rows["none sync"]["of_sync"] is None
    assert rows["none"]["itl_p50_ms"] == 10.0 and rows["none sync"]["itl_p50_ms"] == 12.0


def test_medians_label_a_suffixed_adaptive_method_by_its_mode() -> None:
    cell = adaptive_cell(4, 1.0, 64, overhead=False)
    cell["method"] = "bastion-adaptive-ema_calib"
    cell["server"]["env"] = {"SGLANG_BASTION_MODE": "ema_calib"}
    assert cell_label(cell) == "adaptive N_max=64 ema_calib"


def test_dflash_and_none_use_sglang_own_settings() -> None:
    none, dflash = parse_methods(["none", "dflash"], DRAFTER)
    assert none.args == [] and none.algorithm == "NONE"
    assert option(dflash.args, "--speculative-algorithm") == "DFLASH"
    assert "--speculative-num-draft-tokens" not in dflash.args  # the drafter's block size


@pytest.mark.parametrize(
    ("names", "missing"),
    [(["bastion-adaptive"], "--profile"), (["eagle3"], "--eagle-draft-model-path"),
     (["dflash-ish"], "unknown method"), (["bastion-adaptive-fast"], "unknown method")],
)  # fmt: skip
def test_methods_that_cannot_run_are_refused_naming_the_fix(names: list, missing: str) -> None:
    with pytest.raises(ValueError, match=missing):
        parse_methods(names, DRAFTER)


def test_on_cpu_every_method_gets_the_same_cpu_recipe() -> None:
    for method in parse_methods(["none", "dflash", "bastion-16"], DRAFTER):
        args, env = server_setup(method, ["--random-seed", "1"], on_cpu=True)
        assert option(args, "--attention-backend") == "bastion_cpu"
        assert option(args, "--device") == "cpu"
        assert env["TRITON_INTERPRET"] == "1"
        assert str(CPU_STANDINS) in env["PYTHONPATH"]
        assert args[-2:] == ["--random-seed", "1"]


def test_on_gpu_only_the_users_arguments_are_added() -> None:
    (method,) = parse_methods(["bastion-16"], DRAFTER)
    args, env = server_setup(method, ["--attention-backend", "flashinfer"], on_cpu=False)
    assert args == [*method.args, "--attention-backend", "flashinfer"]
    assert env == method.env


def test_a_trace_folder_gives_each_bastion_server_its_own_trace_file(tmp_path: Path) -> None:
    names = ["none", "dflash", "bastion-8", "bastion-adaptive"]
    methods = parse_methods(names, DRAFTER, None, Path("p.json"))
    traces = {m.name: trace_env(m, tmp_path).get("SGLANG_BASTION_TRACE") for m in methods}
    assert traces == {
        "none": None, "dflash": None,
        "bastion-8": str(tmp_path / "bastion-8.jsonl"),
        "bastion-adaptive": str(tmp_path / "bastion-adaptive.jsonl"),
    }  # fmt: skip
    assert all(trace_env(m, None) == {} for m in methods)


def test_bastion_cells_take_acceptance_and_tree_size_from_counter_deltas() -> None:
    before = info({"request_steps": 10, "tree_nodes": 100, "accepted_tokens": 20})
    after = info({"request_steps": 30, "tree_nodes": 340, "accepted_tokens": 80})
    cell = cell_metrics("bastion-16", "BASTION", 4, bench_result(), before, after)
    assert cell["accept_len"] == pytest.approx(60 / 20)
    assert cell["tree_size"] == pytest.approx(240 / 20)
    assert cell["accept_source"] == cell["tree_source"] == "bastion counters"


def test_adaptive_cells_record_the_step_overhead_the_controller_measured() -> None:
    counters = {"request_steps": 10, "tree_nodes": 100, "accepted_tokens": 20}
    after = info({**counters, "request_steps": 20, "controller": {"overhead_ms": {"4": 9.5}}})
    cell = cell_metrics("bastion-adaptive", "BASTION", 4, bench_result(), info(counters), after)
    assert cell["controller_overhead_ms"] == {"4": 9.5}
    fixed = cell_metrics("bastion-8", "BASTION", 4, bench_result(), info(counters), info(counters))
    assert "controller_overhead_ms" not in fixed


def test_without_bastion_counters_cells_fall_back_to_sglang_reporting() -> None:
    cell = cell_metrics("dflash", "DFLASH", 1, bench_result(accept_length=3.25), info(), info())
    assert cell["accept_len"] == 3.25 and cell["accept_source"] == "sglang avg_spec_accept_length"
    assert cell["tree_size"] == 16.0 and cell["tree_source"] == "block size"


def test_no_speculation_cells_accept_one_token_per_step_of_one_node() -> None:
    cell = cell_metrics("none", "NONE", 1, bench_result(accept_length=None), info(), info())
    assert (cell["accept_len"], cell["tree_size"]) == (1.0, 1.0)


def test_cells_carry_throughput_and_latency_percentiles_from_bench_serving() -> None:
    cell = cell_metrics("none", "NONE", 16, bench_result(), info(), info())
    assert cell["output_tok_s"] == 100.0 and cell["request_s"] == 2.0
    assert (cell["ttft_mean_ms"], cell["ttft_p50_ms"], cell["ttft_p99_ms"]) == (10.0, 9.0, 20.0)
    assert (cell["itl_mean_ms"], cell["itl_p50_ms"], cell["itl_p99_ms"]) == (5.0, 4.0, 8.0)


def test_without_a_profile_the_default_methods_leave_adaptive_out() -> None:
    import sweep

    args = sweep.parse_args(["--model-path", "t", "--draft-model-path", "d"])
    assert args.methods == "none,dflash,bastion-16,bastion-32"
    with_profile = sweep.parse_args(["--model-path", "t", "--profile", "p.json"])
    assert with_profile.methods.endswith(",bastion-adaptive")


def test_arguments_after_a_double_dash_go_to_every_server() -> None:
    import sweep

    args = sweep.parse_args(["--model-path", "t", "--", "--tp-size", "1", "--quick"])
    assert args.extra == ["--tp-size", "1", "--quick"] and not args.quick


def test_results_folder_is_named_by_date_hardware_and_model() -> None:
    name = folder_name("H100 SXM", "training/pair/target", dt.date(2026, 1, 2))
    assert name == "2026-01-02_H100-SXM_pair-target"
    assert folder_name("cpu2", "Qwen/Qwen3-8B", dt.date(2026, 1, 2)).endswith("_Qwen3-8B")


CONFIG = {
    "model": "t", "drafter": "d", "dataset": "humaneval", "num_prompts": None,
    "num_prompts_text": "max(8, 2C)", "output_len": 64, "temperature": 0.0, "extra": [],
}  # fmt: skip


def test_a_saved_folder_resumes_with_its_measured_cells(tmp_path: Path) -> None:
    store = ResultStore(tmp_path, CONFIG, {})
    store.add(cell_metrics("none", "NONE", 1, bench_result(), info(), info()))
    again = ResultStore(tmp_path, CONFIG, {})
    assert again.has("none", 1) and not again.has("none", 4)


def test_a_cell_measured_with_another_server_setup_is_measured_again(tmp_path: Path) -> None:
    (old,) = parse_methods(["bastion-adaptive"], DRAFTER, None, Path("old.json"))
    (new,) = parse_methods(["bastion-adaptive"], DRAFTER, None, Path("new.json"))
    store = ResultStore(tmp_path, CONFIG, {})
    cell = cell_metrics(old.name, "BASTION", 1, bench_result(), info(), info())
    store.add(cell | {"server": old.setup()})
    assert store.has(old.name, 1, old.setup()) and not store.has(new.name, 1, new.setup())
    store.add(cell | {"server": new.setup()})
    assert len(store.cells) == 1 and store.has(new.name, 1, new.setup())


def test_a_folder_measured_with_other_settings_is_not_reused(tmp_path: Path) -> None:
    ResultStore(tmp_path, CONFIG, {}).save()
    with pytest.raises(ValueError, match="output_len"):
        ResultStore(tmp_path, CONFIG | {"output_len": 128}, {})


def test_reports_hold_every_cell_with_speedup_over_no_speculation(tmp_path: Path) -> None:
    store = ResultStore(tmp_path, CONFIG, {"hardware": "cpu2"})
    for method, algorithm, tok_s in [("none", "NONE", 50.0), ("bastion-16", "BASTION", 80.0)]:
        for concurrency in (1, 4):
            result = bench_result(output_throughput=tok_s * concurrency)
            store.add(cell_metrics(method, algorithm, concurrency, result, info(), info()))
    text = write_reports(store, ["none", "bastion-16"], "test sweep")
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("none", "1"),
        ("none", "4"),
        ("bastion-16", "1"),
        ("bastion-16", "4"),
    ]
    assert [float(r["speedup"]) for r in rows] == pytest.approx([1, 1, 1.6, 1.6])
    assert text.count("| bastion-16 |") == 2 and (tmp_path / "sweep.md").read_text() == text
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "sweep.json").read_text())["cells"]) == 4


def test_prompt_files_may_hold_prompts_texts_or_conversations(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    conversation = [{"role": "user", "content": "d"}, {"role": "x", "value": "e"}]
    lines = [{"prompt": "a", "completion": "b"}, {"text": "c"}, {"conversations": conversation}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert jsonl_prompts(path) == [
        {"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""},
        {"prompt": "d", "completion": "e"},
    ]  # fmt: skip


def test_the_bench_dataset_is_two_turn_conversations_stored_once_by_hash(tmp_path: Path) -> None:
    prompts = [{"prompt": "def f():", "completion": ""}]
    path = write_bench_dataset(prompts, tmp_path)
    turns = json.loads(path.read_text())["conversations"]
    assert turns[0]["content"] == "def f():" and len(turns) == 2
    assert path.name == hashlib.sha256(path.read_bytes()).hexdigest()[:16] + ".jsonl"
    assert write_bench_dataset(prompts, tmp_path) == path
    assert write_bench_dataset([{"prompt": "g", "completion": "h"}], tmp_path) != path
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.slow
def test_bench_serving_reads_the_sweeps_command_line_as_meant(tmp_path: Path) -> None:
    argv = bench_argv(
        "http://127.0.0.1:1", "tok", tmp_path / "w.jsonl", 12, 48, 4, 0.5, tmp_path / "r.jsonl"
    )
    args = parse_bench_args(argv)  # SGLang's own parser and defaults (~15 s to import)
    assert (args.dataset_name, args.num_prompts, args.max_concurrency) == ("custom", 12, 4)
    assert (args.sharegpt_output_len, args.temperature) == (48, 0.5)
    assert args.warmup_requests == 0 and args.flush_cache and not args.disable_ignore_eos
    assert not args.disable_stream
    whole = bench_argv(
        "http://127.0.0.1:1",
        "tok",
        tmp_path / "w.jsonl",
        12,
        48,
        4,
        0.5,
        tmp_path / "r.jsonl",
        stream=False,
    )
    assert parse_bench_args(whole).disable_stream  # the short workload takes replies whole


def test_the_short_workload_keeps_the_first_three_lines_of_each_prompt() -> None:
    prompts = [{"prompt": 'def f(x):\n    """Twice x.\n\n    >>> f(2)\n', "completion": "c"}]
    assert short_prompts(prompts) == [
        {"prompt": 'def f(x):\n    """Twice x.\n\n', "completion": "c"}
    ]


# A stand-in server: answers /health and, like SGLang's launcher, has a child process.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    port = int(sys.argv[sys.argv.index("--port") + 1])
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def test_a_server_and_its_children_are_stopped_when_the_measurement_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sweep_server

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    launched: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(command, **kwargs):
        proc = real_popen(
            [sys.executable, str(script), *command[command.index("--port") :]], **kwargs
        )
        launched.append(proc)
        return proc

    monkeypatch.setattr(sweep_server.subprocess, "Popen", popen)
    with (
        pytest.raises(RuntimeError, match="measurement failed"),
        running_server(Path("m"), [], {}, tmp_path / "server.log", timeout_s=30),
    ):
        time.sleep(0.5)  # let the child start
        raise RuntimeError("measurement failed")
    assert not group_alive(launched[0].pid)


def test_stopping_kills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)
    stop_group(proc, grace_s=0.5)
    assert not group_alive(proc.pid)


class _CountingGenerate(BaseHTTPRequestHandler):
    """/generate that records each request and how many were in flight at once."""

    lock = threading.Lock()
    bodies: ClassVar[list[dict]] = []
    in_flight = 0
    most_in_flight = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        time.sleep(0.2)  # long enough for the requests of one round to overlap
        with cls.lock:
            cls.in_flight -= 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        """Quiet."""


def warmed_up(prompts: list[str], **kwargs: object) -> list[dict]:
    """The bodies `warm_up` sends a counting /generate with ``kwargs``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CountingGenerate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _CountingGenerate.bodies, _CountingGenerate.most_in_flight = [], 0
    try:
        warm_up(f"http://127.0.0.1:{server.server_address[1]}", prompts, **kwargs)
    finally:
        server.shutdown()
    return _CountingGenerate.bodies


def test_warm_up_sends_two_rounds_at_the_cells_concurrency_and_length() -> None:
    bodies = warmed_up(["a", "b", "c"], concurrency=4, max_tokens=96)
    assert len(bodies) == 8
    assert 1 < _CountingGenerate.most_in_flight <= 4  # concurrent, never above C
    assert {b["text"] for b in bodies} == {"a", "b", "c"}
    assert all(b["sampling_params"] == {"max_new_tokens": 96, "temperature": 0} for b in bodies)


def test_warm_up_samples_at_the_cells_temperature() -> None:
    bodies = warmed_up(["a"], concurrency=2, max_tokens=8, temperature=1.0)
    assert [b["sampling_params"]["temperature"] for b in bodies] == [1.0] * 4


def adaptive_cell(concurrency: int, tok_s: float, n_max: int, overhead: bool) -> dict:
    """A recorded adaptive cell with the server's N_max and, if measured, its overhead."""
    args = ["--speculative-algorithm", "BASTION", "--speculative-num-draft-tokens", str(n_max)]
    cell = {"method": "bastion-adaptive", "concurrency": concurrency, "output_tok_s": tok_s,
            "tree_size": 9.0, "server": {"args": args}}  # fmt: skip
    return cell | ({"controller_overhead_ms": {"4": 10.0}} if overhead else {})


def test_medians_label_adaptive_cells_by_n_max_and_measured_overhead() -> None:
    assert cell_label(adaptive_cell(4, 1.0, 64, overhead=True)) == "adaptive N_max=64 + overhead"
    assert cell_label(adaptive_cell(4, 1.0, 32, overhead=False)) == "adaptive N_max=32"
    assert cell_label({"method": "bastion-8"}) == "bastion-8"


def test_medians_label_an_adaptive_mode_other_than_static_by_name() -> None:
    cell = adaptive_cell(4, 1.0, 64, overhead=True)
    cell["server"]["env"] = {"SGLANG_BASTION_MODE": "ema_calib"}
    assert cell_label(cell) == "adaptive N_max=64 ema_calib + overhead"
    cell["server"]["env"] = {"SGLANG_BASTION_MODE": "static"}
    assert cell_label(cell) == "adaptive N_max=64 + overhead"


def test_medians_compare_each_setup_with_the_best_fixed_n_median(tmp_path: Path) -> None:
    runs = [(500.0, 520.0, 510.0), (540.0, 500.0, 530.0), (520.0, 510.0, 500.0)]
    folders = []
    for i, (eight, sixteen, adaptive) in enumerate(runs):
        cells = [
            {"method": "bastion-8", "concurrency": 4, "output_tok_s": eight, "tree_size": 8.0},
            {"method": "bastion-16", "concurrency": 4, "output_tok_s": sixteen, "tree_size": 16.0},
            adaptive_cell(4, adaptive, 64, overhead=True),
        ]
        folder = tmp_path / f"r{i}"
        folder.mkdir()
        (folder / "sweep.json").write_text(json.dumps({"cells": cells}))
        folders.append(folder)
    rows = {r["setup"]: r for r in summary_rows(*collect(load_runs(folders)))}
    assert rows["bastion-8"]["median_tok_s"] == 520.0  # median of 500, 540, 520
    assert rows["bastion-16"]["median_tok_s"] == 510.0
    assert rows["adaptive N_max=64 + overhead"]["of_best_fixed"] == pytest.approx(510 / 520)
    assert rows["bastion-8"]["runs"] == 3


def write_run(folder: Path, cells: list[dict]) -> Path:
    """A sweep folder holding only ``cells``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(json.dumps({"cells": cells}))
    return folder


def fixed_cell(n: int, concurrency: int, tok_s: float) -> dict:
    """A recorded fixed-N cell."""
    return {"method": f"bastion-{n}", "concurrency": concurrency, "output_tok_s": tok_s}


def test_run_shares_compare_with_the_best_fixed_n_of_the_same_run(tmp_path: Path) -> None:
    first = write_run(tmp_path / "a", [fixed_cell(8, 4, 400.0), fixed_cell(16, 4, 500.0),
                                       adaptive_cell(4, 490.0, 64, overhead=True)])  # fmt: skip
    second = write_run(tmp_path / "b", [fixed_cell(8, 4, 600.0), fixed_cell(16, 4, 550.0),
                                        adaptive_cell(4, 600.0, 64, overhead=True)])  # fmt: skip
    shares = run_shares(load_runs([first, second]))
    assert shares[("adaptive N_max=64 + overhead", 4)] == pytest.approx([0.98, 1.0])
    assert shares[("bastion-16", 4)] == pytest.approx([1.0, 550 / 600])


def test_rounds_start_the_methods_at_spread_points_of_the_list() -> None:
    import sweep

    names = list("abcdefgh")
    orders = sweep.round_orders(names, 5)
    assert [order[0] for order in orders] == ["a", "b", "d", "e", "g"]
    assert all(sorted(order) == names for order in orders)
    assert sweep.round_orders(names, 1) == [names]


def test_repeats_must_be_positive() -> None:
    import sweep

    with pytest.raises(SystemExit):
        sweep.parse_args(["--model-path", "t", "--repeats", "0"])


def test_repeats_run_each_round_in_its_own_folder_then_write_the_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sweep

    measured: list[tuple[Path, list[str]]] = []

    def fake_sweep(args, order):
        rate = {"bastion-8": 500.0, "bastion-16": 520.0, "none": 300.0}
        cells = [fixed_cell(8, 1, 0.0) | {"method": m, "output_tok_s": rate[m]} for m in order]
        measured.append((args.out, order))
        return write_run(args.out, cells), []

    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    argv = ["--model-path", "t", "--methods", "none,bastion-8,bastion-16", "--repeats", "3",
            "--out", str(tmp_path)]  # fmt: skip
    folder, failed = sweep.run_rounds(sweep.parse_args(argv))
    assert folder == tmp_path and failed == []
    assert [out.name for out, _ in measured] == ["r1", "r2", "r3"]
    assert [order[0] for _, order in measured] == ["none", "bastion-8", "bastion-16"]
    table = (tmp_path / "medians.md").read_text()
    assert "| 1 | bastion-16 | 3 | 520.0 | 100.0% |" in table
    assert "| 1 | none | 3 | 300.0 | 57.7% |" in table
    assert (tmp_path / "medians.png").stat().st_size > 0


def test_a_servers_port_is_chosen_below_the_ports_the_os_hands_out():
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PORT <= port < ephemeral_ports_start() for port in ports)
    assert len(ports) > 1  # chosen at random: two servers starting together rarely meet


def test_never_slower_compares_the_adaptive_median_with_the_best_alternative(
    tmp_path: Path,
) -> None:
    from sweep_never_slower import never_slower_rows

    cells = [
        {"method": "none", "concurrency": 16, "output_tok_s": 200.0},
        {"method": "dflash", "concurrency": 16, "output_tok_s": 150.0},
        fixed_cell(8, 16, 180.0),
        {"method": "none-sync", "concurrency": 16, "output_tok_s": 400.0,
         "server": {"args": ["--disable-overlap-schedule"]}},
        adaptive_cell(16, 190.0, 32, overhead=False),
    ]  # fmt: skip
    (row,) = never_slower_rows(collect(load_runs([write_run(tmp_path, cells)]))[0])
    assert row["setup"] == "adaptive N_max=32" and row["best"] == "none"
    assert row["of_best"] == pytest.approx(190 / 200)
    assert row["of"] == pytest.approx({"none": 0.95, "dflash": 190 / 150, "bastion-8": 190 / 180})


def test_never_slower_takes_the_adaptive_ratio_round_by_round_as_well(tmp_path: Path) -> None:
    from sweep_never_slower import markdown, never_slower_rows

    # the host ran twice as fast in the second round: by medians of rates adaptive loses
    # (150 against 200), while it was at 95%, 100% and 90% of no speculation in each round
    rates = ((100.0, 95.0), (400.0, 400.0), (200.0, 180.0))
    folders = [
        write_run(tmp_path / f"r{i}", [{"method": "none", "concurrency": 4, "output_tok_s": none},
                                       adaptive_cell(4, adaptive, 32, overhead=False)])
        for i, (none, adaptive) in enumerate(rates)
    ]  # fmt: skip
    runs = load_runs(folders)
    (row,) = never_slower_rows(collect(runs)[0], None, runs)
    assert row["of_best"] == pytest.approx(180 / 200)
    assert row["rounds"] == pytest.approx([0.95, 1.0, 0.9])
    assert "| 95% / 100% / 90% | **95.0%** |" in markdown([row])


def test_never_slower_leaves_dflash_out_of_a_sampled_cpu_sweep(tmp_path: Path) -> None:
    from sweep_never_slower import excluded_references, never_slower_rows

    cells = [{"method": "dflash", "concurrency": 1, "output_tok_s": 300.0},
             {"method": "none", "concurrency": 1, "output_tok_s": 100.0},
             adaptive_cell(1, 120.0, 32, overhead=False)]  # fmt: skip
    folder = write_run(tmp_path, cells)
    data = json.loads((folder / "sweep.json").read_text())
    for temperature, on_cpu, left_out in ((1.0, True, True), (0.0, True, False),
                                          (1.0, False, False)):  # fmt: skip
        data["config"] = {"temperature": temperature, "on_cpu": on_cpu}
        (folder / "sweep.json").write_text(json.dumps(data))
        excluded = excluded_references([folder])
        (row,) = never_slower_rows(collect(load_runs([folder]))[0], excluded)
        assert ("dflash" in excluded) is left_out
        assert row["best"] == ("none" if left_out else "dflash")


def test_never_slower_marks_a_cell_under_the_best_alternative_in_bold(tmp_path: Path) -> None:
    from sweep_never_slower import markdown, never_slower_rows

    cells = [{"method": "none", "concurrency": c, "output_tok_s": 100.0} for c in (1, 64)]
    cells += [adaptive_cell(1, 110.0, 32, overhead=False), adaptive_cell(64, 90.0, 32, False)]
    table = markdown(never_slower_rows(collect(load_runs([write_run(tmp_path, cells)]))[0]))
    assert "| 1 | adaptive N_max=32 | 110.0 | none | 100.0 | 110.0% | 110.0% |" in table
    assert "| 64 | adaptive N_max=32 | 90.0 | none | 100.0 | **90.0%** | **90.0%** |" in table


def test_every_server_of_a_sweep_serves_at_one_request_cap() -> None:
    import sweep

    default = sweep.parse_args(["--model-path", "t"])
    assert sweep.cap_args(default) == ["--max-running-requests", "48"]
    assert sweep.cap_args(sweep.parse_args(["--model-path", "t", "--max-running-requests", "0"]))\
        == []  # fmt: skip


def test_a_cpu_sweep_pool_holds_its_cap_of_longest_requests_with_the_speculative_reserve() -> None:
    # 48 requests of 495 prompt + 64 output tokens, each with 2 x 32 reserved: 29,832 tokens.
    assert pool_tokens(48, 495, 64, 32) == 30720  # rounded up to 1024
    assert pool_tokens(48, 495, 64, 32) >= 48 * (495 + 64 + 64)


def test_the_pool_reserve_is_sized_by_the_largest_draft_token_window_of_a_sweep() -> None:
    methods = parse_methods(["none", "bastion-8", "bastion-48"], Path("d"))
    assert largest_window(methods) == 48
    assert largest_window(parse_methods(["none", "dflash"], Path("d"))) == 32  # the default


def test_a_gpu_sweep_or_one_without_a_cap_keeps_each_servers_own_pool() -> None:
    import sweep

    args = sweep.parse_args(["--model-path", "t"])
    assert sweep.pool_args(args, [{"prompt": "x"}], [], on_cpu=False) == []
    uncapped = sweep.parse_args(["--model-path", "t", "--max-running-requests", "0"])
    assert sweep.pool_args(uncapped, [{"prompt": "x"}], [], on_cpu=True) == []


def test_interleaved_rounds_measure_each_concurrency_method_after_method_the_others_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    import sweep

    started: list[str] = []
    paused: set[int] = set()
    measured: list[tuple[str, str, int]] = []  # (round folder, method, concurrency)

    @contextlib.contextmanager
    def fake_server(method, args, logs, progress, groups):
        started.append(method.name)
        groups.append(100 + len(started))  # its process group
        yield f"http://{method.name}"

    def fake_cell(method, url, concurrency, args, store, dataset, warm, progress):
        group = 100 + started.index(method.name) + 1
        assert group not in paused and len(paused) == len(started) - 1  # only it runs
        measured.append((store.folder.name, method.name, concurrency))
        rate = {"none": 300.0, "bastion-8": 500.0}[method.name] * concurrency
        store.add(fixed_cell(8, concurrency, rate) | {"method": method.name,
                                                      "server": method.setup()})  # fmt: skip

    monkeypatch.setattr(sweep, "method_server", fake_server)
    monkeypatch.setattr(sweep, "measure_cell", fake_cell)
    monkeypatch.setattr(sweep, "pause_group", paused.add)
    monkeypatch.setattr(sweep, "resume_group", paused.discard)
    monkeypatch.setattr(sweep, "write_reports", lambda *args: "")
    argv = ["--model-path", "t", "--draft-model-path", "d", "--methods", "none,bastion-8",
            "--concurrency", "1,4", "--repeats", "2", "--interleave",
            "--max-running-requests", "0", "--out", str(tmp_path)]  # fmt: skip
    folder, failed = sweep.run_rounds(sweep.parse_args(argv))
    assert failed == [] and started == ["none", "bastion-8"]  # one server per method
    assert measured == [
        ("r1", "none", 1), ("r1", "bastion-8", 1), ("r1", "none", 4), ("r1", "bastion-8", 4),
        ("r2", "bastion-8", 1), ("r2", "none", 1), ("r2", "bastion-8", 4), ("r2", "none", 4),
    ]  # fmt: skip
    assert paused == {101, 102}  # both paused between their cells
    assert "| 4 | bastion-8 | 2 | 2000.0 |" in (folder / "medians.md").read_text()
