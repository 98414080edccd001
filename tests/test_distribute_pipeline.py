"""Pipeline stages (`kpipe.distribute.pipeline_model`) on 3 logical CPU devices, checked against
the unsplit model in one fresh process (`tests/programs/pipeline_cpu.py`): TensorFlow starts
once, every test below reads its part of the program's JSON report."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import orphaned_shm, shm_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
ENV.pop("TF_CONFIG", None)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "report.json"
    before = shm_entries()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "programs", "pipeline_cpu.py"), str(out)],
                          env=ENV, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_new_shm"] = sorted(orphaned_shm(shm_entries() - before))  # (entries no process uses: not another run's)
    return result


def part(report, name):
    value = report[name]
    assert not (isinstance(value, dict) and "error" in value), value.get("error")
    return value


def test_losses_equal_the_unsplit_model_for_1_2_4_microbatches(report):
    r = part(report, "loss_equal")
    assert [(run["stages"], run["microbatches"]) for run in r["runs"]] == [(2, 1), (2, 2), (2, 4), (3, 4)]
    for run in r["runs"]:
        np.testing.assert_allclose(run["loss"], r["unsplit_loss"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(run["accuracy"], r["unsplit_accuracy"], rtol=0, atol=1e-6)
        assert run["max_weight_diff"] < 1e-5, run
    assert r["unsplit_loss"][-1] < r["unsplit_loss"][0]  # it trained
    assert r["runs"][0]["split"] == [["conv", "flat"], ["hidden", "hidden2", "logits"]]
    three = r["runs"][-1]["split"]  # split_at=None: balanced by weights, every stage has layers
    assert len(three) == 3 and all(three) and sum(three, []) == ["conv", "flat", "hidden", "hidden2", "logits"]


def test_stage_variables_and_optimizer_slots_live_on_their_device(report):
    r = part(report, "placement")
    assert r["var_devices"] == [[0, 0], [1, 1], [2, 2, 2, 2]]
    assert r["slot_devices"] == {"0": [0] * 4, "1": [1] * 4, "2": [2] * 8}  # Adam: 2 slots per variable


def test_forward_and_backward_ops_of_stage_k_request_device_k(report):
    graph = part(report, "placement")["graph"]
    kernels = {0: ("Conv2D", "Conv2DBackpropFilter"), 1: ("MatMul", "ReluGrad"), 2: ("MatMul", "TanhGrad")}
    for k in range(3):
        forward, backward = graph[f"{k}/forward"], graph[f"{k}/backward"]
        assert forward["devices"].keys() == {str(k)}, forward
        assert backward["devices"].keys() == {str(k)}, backward
        assert forward["microbatches"] == backward["microbatches"] == 4
        assert kernels[k][0] in forward["types"] and kernels[k][1] in backward["types"]
        assert backward["unplaced_types"] == []
        # Resource reads follow their variable; nothing else is left to the placer.
        assert set(forward["unplaced_types"]) <= {"Placeholder", "ReadVariableOp"}
    # The optimizer's update of each variable runs on that variable's device.
    optimizer, per_stage = graph["optimizer"], part(report, "placement")["vars_per_stage"]
    assert optimizer["devices"].keys() == {"0", "1", "2"}
    per_variable = {optimizer["devices"][str(k)] / per_stage[k] for k in range(3)}
    assert len(per_variable) == 1 and per_variable.pop() > 5, optimizer


def test_class_weights_and_callbacks(report):
    r = part(report, "class_weight_and_callback")
    np.testing.assert_allclose(r["loss"], r["unsplit_loss"], rtol=0, atol=1e-5)
    assert abs(r["loss"][0] - r["plain_loss"][0]) > 0.1  # the class weights did weigh
    assert r["callback_batches"] == 3 * 5  # 3 epochs of 5 batches
    assert r["callback_losses"] == r["loss"]


def test_process_loader_and_tf_data_input(report):
    r = part(report, "inputs")
    np.testing.assert_allclose(r["loader_loss"], r["unsplit_loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(r["tfdata_loss"], r["unsplit_loss"], rtol=0, atol=1e-5)


def test_predict_evaluate_and_call_match_the_unsplit_model(report):
    r = part(report, "predict_evaluate")
    assert r["predict_diff"] < 1e-5 and r["call_diff"] < 1e-5
    np.testing.assert_allclose(r["evaluate"], r["evaluate_unsplit"], rtol=0, atol=1e-6)


def test_weight_files_are_interchangeable_both_ways(report):
    r = part(report, "weights_interchangeable")
    assert r["pipeline_to_unsplit_diff"] == 0.0 and r["unsplit_to_pipeline_diff"] == 0.0
    assert r["paths_equal"] and r["n_paths"] == 10 + 16  # 5 layers' kernels and biases + Adam's state
    assert r["layer_names"] and r["weight_shapes"]
    assert r["loaded_devices"] == [0, 0, 1, 1, 2, 2, 2, 2]  # loading keeps each variable on its device


def test_sequential_model_in_three_stages_with_a_weight_regularizer(report):
    r = part(report, "sequential_three_stages")
    assert r["split"] == [["s1"], ["s2", "s3"], ["s4"]]
    assert r["devices"] == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    np.testing.assert_allclose(r["loss"], r["unsplit_loss"], rtol=1e-6)


def test_balanced_split_cuts_only_where_one_tensor_crosses(report):
    r = part(report, "balanced_split")
    # Inside the residual block two tensors would cross; after the join only one does.
    assert r["split"] == [["block_in", "branch", "join"], ["wide", "head"]]
    assert r["params"] == [6 * 6 + 6 + 6 * 6 + 6, 6 * 32 + 32 + 32 + 1]


@pytest.mark.parametrize("case, error, words", [
    ("skip_connection", "ValueError", ["after layer 'branch'", "'block_in' is used by 'join'", "skip connection"]),
    ("unknown_layer", "ValueError", ["split_at[0]", "'nope'", "'block_in'"]),
    ("wrong_count", "ValueError", ["must name 2 layer(s) for 3 devices", "split_at='join'"]),
    ("out_of_order", "ValueError", ["model order", "'join' does not come after 'wide'"]),
    ("input_layer", "ValueError", ["after layer 'x'", "input layer"]),
    ("last_layer", "ValueError", ["after layer 'head'", "last stage would be empty"]),
    ("missing_device", "ValueError", ["devices[1]='/cpu:7'", "Available: ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']"]),
    ("gpu_device", "ValueError", ["devices[1]='/gpu:0'", "Available:"]),
    ("no_devices", "ValueError", ["non-empty list", "devices=[]"]),
    ("device_string", "ValueError", ["non-empty list", "devices='/cpu:0'"]),
    ("microbatches_zero", "ValueError", ["num_microbatches=0", "int >= 1"]),
    ("microbatches_bool", "ValueError", ["num_microbatches=True"]),
    ("microbatches_float", "ValueError", ["num_microbatches=2.0"]),
    ("too_many_stages", "ValueError", ["1 place(s) where it can be cut", "3 devices need 2"]),
    ("subclassed", "TypeError", ["functional or Sequential", "Dense"]),
    ("jit_compile", "ValueError", ["jit_compile=True", "XLA"]),
    ("build_under_strategy", "RuntimeError", ["MirroredStrategy", "strategy.scope()"]),
    ("fit_under_strategy", "RuntimeError", ["Cannot train a pipeline model under a `MirroredStrategy` scope"]),
])
def test_errors_name_the_argument_and_the_fix(report, case, error, words):
    got = part(report, "errors")[case]
    assert got["type"] == error, got
    for word in words:
        assert word in got["message"], got["message"]


def test_batch_normalization_warns_about_microbatch_statistics(report):
    r = part(report, "batchnorm_warning")
    assert len(r["warnings"]) == 1 and "'bn'" in r["warnings"][0] and "2 micro-batches" in r["warnings"][0]
    assert r["warning_files"] == ["pipeline_cpu.py"]  # stacklevel points at the caller
    assert r["quiet"] == []  # num_microbatches=1: same statistics, no warning
    assert np.isfinite(r["loss"]).all()
    # a batch of fewer rows than micro-batches runs no micro-batch of 0 rows (its
    # statistics, the moving mean and variance, would be NaN)
    assert r["weights_finite"]


def test_no_shared_memory_left_behind(report):
    assert report["_new_shm"] == []
