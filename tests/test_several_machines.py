"""Several machines, for real: the batch files of slurm/ on a 2-node Slurm cluster that
scripts/cluster.sh builds on this machine (two network namespaces joined by a veth pair, each with
its own hostname), and plain srun of one task per process.

What this cannot show: NCCL or InfiniBand between hosts (there is no GPU and one kernel), nor a
filesystem that is not shared (both nodes see the host's). See docs/several-machines.md.
"""
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import common
from conftest import (EXACT, DEV_SAMPLES, PYTHON, ROOT, SMALL, assert_same_weights, processes_mentioning,
                      read_result, run)

SLURM_TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
              "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1",
              "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


@pytest.fixture
def slurm_task(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(common, "srun_started_this_process", False)


def test_an_srun_task_takes_its_rank_and_rendezvous_from_slurm(slurm_task):
    assert common.launch_environment("torchrun ...") == (1, 3, 0, 1)  # node 1 of "2,1" runs one task
    assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["MASTER_PORT"] == str(15000 + 123456 % 10000)
    assert common.srun_started_this_process


def test_master_addr_and_port_set_by_the_user_win(slurm_task, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    monkeypatch.setenv("MASTER_PORT", "29999")
    common.launch_environment("torchrun ...")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29999")


def test_a_batch_script_without_srun_still_gets_the_launcher_error(slurm_task, monkeypatch):
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script itself: srun did not start this process
    with pytest.raises(common.UserError, match="runs under a launcher"):
        common.launch_environment("torchrun ...")


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("node[1-2]", "node1"),
                                             ("gpu[07-09,12]-ib,cpu1", "gpu07-ib"), ("cpu1,gpu[1-2]", "cpu1")])
def test_the_first_host_of_a_node_list(nodelist, first):
    assert common.first_host(nodelist) == first


def test_tasks_per_node_expand():
    assert common.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
