"""Bad input gets one clear line naming the problem and a non-zero exit, never a traceback.

Each check ends before training, so it runs the script in this interpreter (run_in_process), the
quick tier's too. The error line of a Python of its own: test_gpu_plan.py's refusals, and a failing
rank's under its launcher (test_native.py, test_reliability.py)."""
import json
import shutil
import socket
import time

import pytest

from conftest import SAMPLES, SMALL, run_in_process


def train(*extra, data=None, env=None):
    args = ["single-gpu-cls.py", *SMALL, *extra]
    if data is not None:
        args += ["--data", str(data)]
    return run_in_process(args, env=env)


def assert_clean_error(process, *fragments):
    assert process.returncode != 0
    lines = process.stderr.strip().splitlines()
    assert "Traceback" not in process.stderr, process.stderr
    assert lines and lines[-1].startswith("error: "), process.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def write(tmp_path, content):
    path = tmp_path / "data.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content, ensure_ascii=False),
                    encoding="utf-8")
    return path


GOOD = [["今天 天气 真好", 5]] * 3


@pytest.mark.parametrize("content, fragments", [
    ("[[\"今天\", 1],", ["not valid JSON"]),
    ({"text": "x"}, ["JSON list"]),
    (GOOD + [["只有 文本"]], ["record 3", "not [text, label]"]),
    (GOOD + [[5, "今天"]], ["record 3", "not [text, label]"]),
    (GOOD + [["今天", 6]], ["record 3", "label 6"]),
    (GOOD + [["今天", "2"]], ["record 3", "label '2'"]),
    (GOOD + [[" \n", 2]], ["record 3", "empty text"]),
    (GOOD + [["\x00\x07\u200b", 2]], ["record 3", "empty text"]),  # the tokenizer drops control characters
])
def test_malformed_data_is_named_with_its_record(tmp_path, content, fragments):
    path = write(tmp_path, content)
    assert_clean_error(train(data=path), str(path), *fragments)


@pytest.mark.quick
def test_missing_data_file(tmp_path):
    assert_clean_error(train(data=tmp_path / "nope.json"), "data file not found", "nope.json")


def test_more_samples_than_the_data_has(tmp_path):
    path = write(tmp_path, GOOD * 10)
    assert_clean_error(train(data=path), f"--max-samples {SAMPLES}", "(30)")


def test_a_data_folder_is_named_as_a_folder(tmp_path):
    assert_clean_error(train(data=tmp_path), f"--data {tmp_path} is a folder", "like data/train.json")


def test_a_global_batch_larger_than_the_training_set_is_refused():
    assert_clean_error(train("--batch-size", "1000000"), "a global batch of 1,000,000",
                       f"more than the {SAMPLES - round(SAMPLES * 0.2)} training samples")


def test_a_hub_model_without_network_is_refused_at_once_saying_how_to_get_it(monkeypatch):
    """No network (the hub's host unreachable) and no cached copy: one line with the download
    command, in seconds, not after the hub client's minute of retries; no HF_HUB_OFFLINE needed."""
    from huggingface_hub import constants

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # restored after the test: the check sets it
    start = time.monotonic()
    process = train("--model", "someone/not-cached-model")
    assert_clean_error(process, "someone/not-cached-model is not in the Hugging Face cache",
                       "hf download someone/not-cached-model --local-dir")
    assert time.monotonic() - start < 20


def test_missing_model_folder(tmp_path):
    assert_clean_error(train("--model", str(tmp_path / "no-model")), "model not found", "no-model")


def test_folder_that_is_not_a_model(tmp_path):
    assert_clean_error(train("--model", str(tmp_path)), "could not load model", str(tmp_path))


def test_bad_option_value():
    assert_clean_error(train("--batch-size", "0"), "--batch-size must be at least 1")


def test_cuda_asked_for_on_a_machine_without_it():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    assert_clean_error(train("--device", "cuda"), "--device cuda")


@pytest.mark.quick
def test_predict_with_a_missing_checkpoint(tmp_path):
    process = run_in_process(["predict.py", "--checkpoint", str(tmp_path / "model"), "你好"])
    assert_clean_error(process, "no saved model", str(tmp_path / "model"))


def test_predict_with_no_text(tmp_path):
    process = run_in_process(["predict.py", "--checkpoint", str(tmp_path)])
    assert_clean_error(process, "no text to classify")


def test_predict_reads_its_texts_from_standard_input_with_file_dash(single_reference, monkeypatch):
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("今天 天气 真好\n\n气死我了\n".encode())))
    process = run_in_process(["predict.py", "--checkpoint", single_reference / "model", "--file", "-"])
    assert process.returncode == 0, process.stderr
    assert [line.split("\t")[-1] for line in process.stdout.splitlines()] == ["今天 天气 真好", "气死我了"]


@pytest.mark.parametrize("option, value, fragment", [
    ("--lr", "-1", "--lr must be a positive number, got -1"),
    ("--lr", "inf", "--lr must be a positive number, got inf"),
    ("--weight-decay", "-0.1", "--weight-decay must be a number, 0 or more"),
    ("--weight-decay", "nan", "--weight-decay must be a number, 0 or more, got nan"),
    ("--max-steps", "-1", "--max-steps must be 0 or more, got -1"),
    ("--seed", "-5", "--seed must be between 0 and 2**32 - 1"),
    ("--seed", str(2**32), "--seed must be between 0 and 2**32 - 1"),
    ("--num-workers", "-1", "--num-workers must be 0 or more, got -1"),
    ("--eval-steps", "-1", "--eval-steps must be 0 or more, got -1"),
    ("--dropout", "1.5", "--dropout must be at least 0 and below 1, got 1.5"),
    ("--max-seq-len", "1", "--max-seq-len must be at least 3"),
])
def test_bad_numbers_are_refused_before_any_work(option, value, fragment):
    assert_clean_error(train(option, value, "--data", "no-such-file.json"), fragment)  # before the data is read


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_dist_timeout_that_is_not_positive_is_refused(value):
    process = run_in_process(["multi-gpu-distributed-cls.py", *SMALL, "--dist-timeout", value])
    assert_clean_error(process, "--dist-timeout must be a positive number of seconds")


@pytest.mark.parametrize("value", ["0", "1", "-5"])
def test_predict_refuses_a_max_seq_len_too_short_for_one_token(value):
    process = run_in_process(["predict.py", "--checkpoint", "nowhere", "--max-seq-len", value, "你好"])
    assert_clean_error(process, "--max-seq-len must be at least 3")


def test_predict_refuses_a_binary_file(tmp_path):
    path = tmp_path / "texts.bin"
    path.write_bytes(bytes(range(256)))
    process = run_in_process(["predict.py", "--checkpoint", str(tmp_path), "--file", str(path)])
    assert_clean_error(process, str(path), "is not UTF-8 text")


def test_a_truncated_model_is_named_in_training_and_in_predict(tmp_path, single_reference):
    model = shutil.copytree(single_reference / "model", tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_clean_error(train("--model", str(model), "--output-dir", str(tmp_path / "out")), "could not load model",
                       str(model))
    assert_clean_error(run_in_process(["predict.py", "--checkpoint", str(model), "你好"]),
                       "could not load the model", str(model))


def test_an_output_dir_that_is_a_file_is_refused_before_training(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x", encoding="utf-8")
    assert_clean_error(train("--output-dir", str(path), "--data", "no-such-file.json"), str(path), "is a file")


def test_predict_refuses_an_empty_text(tmp_path):
    """Empty by training's rule (common.empty_text): zero-width and control characters are no text either."""
    process = run_in_process(["predict.py", "--checkpoint", str(tmp_path), "你好", ""])
    assert_clean_error(process, "text 2 of the arguments is empty")
    process = run_in_process(["predict.py", "--checkpoint", str(tmp_path), "你好", "\u200b\u200d\x07"])
    assert_clean_error(process, "text 2 of the arguments is empty (only spaces, control or zero-width characters)")


def test_predict_refuses_a_model_without_its_tokenizer(tmp_path, single_reference):
    """Without its vocabulary every character would be [UNK], each text classified alike."""
    shutil.copytree(single_reference / "model", tmp_path / "model")
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "model" / name).unlink(missing_ok=True)
    process = run_in_process(["predict.py", "--checkpoint", tmp_path / "model", "今天天气真好"])
    assert_clean_error(process, f"the model at {tmp_path / 'model'} has no tokenizer")


@pytest.mark.parametrize("script", ["multi-gpu-distributed-cls.py", "multi-gpu-deepspeed-cls.py"])
def test_a_launcher_without_local_rank_gets_one_line(script):
    """Some srun/mpirun wrappers set RANK and WORLD_SIZE but not the local ones."""
    process = run_in_process([script, *SMALL], env={"RANK": "0", "WORLD_SIZE": "1"})
    assert_clean_error(process, "not LOCAL_RANK and LOCAL_WORLD_SIZE")


def test_nccl_asked_for_between_cpu_processes_gets_one_line():
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    process = run_in_process(["multi-gpu-distributed-cls.py", *SMALL, "--backend", "nccl"], env=environment)
    assert_clean_error(process, "--backend nccl needs GPUs")


def test_the_deepspeed_launchers_process_ids_give_no_gpu(monkeypatch):
    """`deepspeed --num_gpus 2` on a CPU machine sets CUDA_VISIBLE_DEVICES=0,1 (its local process ids)
    beside CROSS_RANK and LOCAL_SIZE: the script trains on the CPU, as ./run.sh's deepspeed row does.
    The same list set by anyone else still gives GPUs that torch cannot see."""
    import torch
    from support import cli
    from support import machine
    for name in [*machine.GPU_VARIABLES, "SLURM_JOB_ID", "CROSS_RANK", "LOCAL_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(cli.UserError, match="^CUDA_VISIBLE_DEVICES=0,1 gives this process GPUs"):
        machine.resolve_device("auto", 1)
    monkeypatch.setenv("CROSS_RANK", "0")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert machine.resolve_device("auto", 1) == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # not the launcher's list
    with pytest.raises(cli.UserError, match="^CUDA_VISIBLE_DEVICES=2,3 gives this process GPUs"):
        machine.resolve_device("auto", 1)


def test_more_processes_than_gpus_share_them_only_over_gloo(monkeypatch):
    """Checked in this process, with torch told it sees 2 GPUs: local rank 2 has none of its own."""
    import torch
    from support import cli
    from support import machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert machine.resolve_device("auto", 1) == torch.device("cuda", 1)
    with pytest.raises(cli.UserError, match="local rank 2 has no GPU.*--backend gloo"):
        machine.resolve_device("auto", 2, share_gpus=False)  # a DDP script: it takes --backend
    with pytest.raises(cli.UserError, match="processes per machine$"):
        machine.resolve_device("auto", 2)  # a script without --backend is not told to use it
    assert machine.resolve_device("auto", 2, share_gpus=True) == torch.device("cuda", 0)
    assert machine.resolve_device("auto", 3, share_gpus=True) == torch.device("cuda", 1)
    assert machine.resolve_device("cpu", 3) == torch.device("cpu")
    assert machine.backend_for(torch.device("cuda", 0)) == "nccl"
    assert machine.backend_for(torch.device("cuda", 0), "gloo") == "gloo"


def test_a_second_run_into_the_same_output_dir_is_refused_naming_the_first(tmp_path):
    """The first run is another open lock of the folder, as another process's would be; the OS drops
    it with its holder, so a lock file left by a run that crashed stops nobody. A folder in what a
    running run replaces at its next save (its model/ here), or holding such a run, is refused too."""
    import fcntl
    from support.folder import LOCK_FILE
    folder = tmp_path / "model"
    folder.mkdir()
    with open(folder / LOCK_FILE, "w", encoding="utf-8") as first:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.write("the run of pid 4242 on somehost")
        first.flush()
        assert_clean_error(train("--output-dir", str(folder)), f"--output-dir {folder} is in use by the run "
                                                                "of pid 4242 on somehost")
        assert_clean_error(train("--output-dir", folder / "checkpoint" / "mine"),
                           f"lies in {folder / 'checkpoint'}, which the run holding {folder} replaces")
        assert_clean_error(train("--output-dir", tmp_path), f"the run holding {folder} lies in its model/")
    assert_clean_error(train("--output-dir", str(folder), "--data", "no-such-file.json"), "data file not found")
    assert list(tmp_path.iterdir()) == [folder] and not list(folder.iterdir())  # the lock is removed with its run


def test_a_read_only_output_dir_is_refused_before_training(tmp_path):
    from test_reliability import mounted_tmpfs
    with mounted_tmpfs(tmp_path, "ro"):
        assert_clean_error(train("--output-dir", str(tmp_path / "out")), f"--output-dir {tmp_path / 'out'} is not "
                                                                          "writable: Read-only file system")


def link(path, target):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def folder_holding(path, name, make):
    """`path`, a new folder, with `make(path / name)` done in it."""
    path.mkdir()
    make(path / name)
    return path


@pytest.mark.parametrize("output_dir, fragment", [
    (lambda tmp: "", "--output-dir is empty"),  # else the current folder's model/ and result.json are replaced
    (lambda tmp: link(tmp / "loop", "loop"), "loop cannot be used: Too many levels of symbolic links"),
    (lambda tmp: link(tmp / "dangling", "nowhere") / "out", "dangling is a link to nowhere, which does not exist"),
    (lambda tmp: tmp / ("名" * 100) / "out", "is 300 bytes, its filesystem holds at most 255"),
    (lambda tmp: tmp.joinpath(*["d" * 254] * 15), "bytes long, too long for the run's files below it"),
    (lambda tmp: folder_holding(tmp / "out", ".lock", lambda path: path.mkdir()), "holds a folder named .lock,"),
    (lambda tmp: folder_holding(tmp / "out", "model", lambda path: path.symlink_to(path)), "holds links (model)"),
    # Not moved aside (to .model.old-PID, and left there), nor failed on after the whole training.
    (lambda tmp: folder_holding(tmp / "out", "model", lambda path: path.touch()), "holds a file named model, where"),
    (lambda tmp: folder_holding(tmp / "out", "checkpoint", lambda path: path.touch()), "a file named checkpoint"),
    (lambda tmp: folder_holding(tmp / "out", "tensorboard", lambda path: path.touch()), "a file named tensorboard"),
    (lambda tmp: folder_holding(tmp / "out", "result.json", lambda path: path.mkdir()), "a folder named result.json"),
])
def test_an_output_dir_no_run_can_use_is_named_before_any_work(tmp_path, output_dir, fragment):
    assert_clean_error(train("--output-dir", output_dir(tmp_path), data="no-such-file.json"), fragment)


def test_a_link_in_the_output_dir_is_not_written_through(tmp_path):
    """A run writes only inside its folder: a .lock (or trace.json, model/, ...) that links elsewhere is refused."""
    outside = tmp_path / "someone-elses-file"
    outside.write_text("precious", encoding="utf-8")
    output_dir = folder_holding(tmp_path / "out", ".lock", lambda path: path.symlink_to(outside))
    assert_clean_error(train("--output-dir", output_dir, data="no-such-file.json"), "holds links (.lock)")
    assert outside.read_text(encoding="utf-8") == "precious"


def test_a_process_alone_in_its_world_is_rank_0_whatever_rank_it_is_given(tmp_path, monkeypatch):
    """A RANK left in the environment of one process: no rank 0 would lock the folder or speak for it.
    A script that never runs in a group (launch.in_a_group) believes no RANK, whatever WORLD_SIZE says."""
    import fcntl
    from support import cli, launch
    from support.folder import LOCK_FILE
    with open(tmp_path / LOCK_FILE, "w", encoding="utf-8") as first:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for stray in ({"RANK": "1"}, {"RANK": "1", "WORLD_SIZE": "2"}):
            assert_clean_error(train("--output-dir", tmp_path, data="no-such-file.json", env=stray),
                               "is in use by another run")
    assert_clean_error(train("--epochs", "0", env={"RANK": "1", "WORLD_SIZE": "2"}), "--epochs must be at least 1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if name != "LOCAL_RANK" else "0")
    with pytest.raises(cli.UserError, match="^the launcher set RANK=1, WORLD_SIZE=1, "):  # else it waits for rank 0
        launch.launch_environment("torchrun")


@pytest.mark.parametrize("name, value, rule", [("WORLD_SIZE", "two", "1 or more"), ("LOCAL_RANK", "x", "0 or more"),
                                               ("MASTER_PORT", "abc", "1-65535"), ("MASTER_PORT", "99999", "1-65535"),
                                               ("RANK", "-1", "0 or more")])
def test_a_launch_variable_breaking_its_rule_is_refused_before_any_work(name, value, rule):
    """launch.LAUNCH_VARIABLES: every process of a group script checks them as it starts."""
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", name: value}
    process = run_in_process(["multi-gpu-distributed-cls.py", *SMALL, "--data", "no-such-file.json"], env=environment)
    assert_clean_error(process, f"{name}={value!r}: a launch variable must be a whole number, {rule}")


def test_predict_refuses_a_max_seq_len_beyond_the_models_positions(single_reference):
    model = single_reference / "model"
    process = run_in_process(["predict.py", "--checkpoint", model, "--max-seq-len", "513", "你好"])
    assert_clean_error(process, "--max-seq-len 513 exceeds the model's 512 positions")  # as training says it
