"""Launching on a cluster: one run directory for all nodes, `srun` without a launcher, resume_from=auto."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time

import pytest

import models.training.distributed
import train
from models.training import launch
from models.training.checkpoint import resolve_checkpoint
from models.training.distributed import DistInfo, dist_info
from tests.conftest import TINY

LAUNCH_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
               "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
               "MASTER_PORT")


@pytest.fixture
def launch_env(monkeypatch):
    """A clean launcher environment; `launch_env(**vars)` sets some (all restored after the test)."""
    for key in LAUNCH_VARS:
        monkeypatch.setenv(key, "")  # recorded, so that a variable the code under test exports is undone too
        monkeypatch.delenv(key)

    def set_vars(**env: str) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return set_vars


@pytest.mark.parametrize("env, name", [
    ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
    ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "3"}, "slurm-4200_3"),
    ({"TORCHELASTIC_RUN_ID": "job7", "LOCAL_WORLD_SIZE": "2"}, "torchrun-job7"),
])
def test_ranks_on_different_nodes_name_one_run_directory(launch_env, monkeypatch, env, name):
    """Two ranks whose launchers (their parents) started at different times: one name from the launch id."""
    launch_env(WORLD_SIZE="4", **env)
    stamps = []
    for parent in (1, os.getpid()):
        monkeypatch.setattr(os, "getppid", lambda parent=parent: parent)
        stamps.append(launch.run_stamp())
    assert stamps[0] == stamps[1] == name


def test_a_single_node_launcher_names_the_run_by_its_start_time(launch_env):
    launch_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", launch.run_stamp())


def test_srun_without_a_launcher_maps_slurm_variables(launch_env, monkeypatch):
    launch_env(SLURM_JOB_ID="123456", SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8",
               SLURM_STEP_NUM_TASKS="8", SLURM_STEP_NODELIST="gpu-a[007-008,010],gpu-b3", SLURM_JOB_NODELIST="x")
    assert dist_info() == DistInfo(rank=5, world_size=8, local_rank=1)
    expected = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu-a007", "MASTER_PORT": "18456"}
    assert models.training.distributed.slurm_env() == expected
    # init_distributed exports them for deepspeed / torch.distributed, which read the environment.
    import deepspeed

    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: None)
    models.training.distributed.init_distributed(5)
    assert {k: os.environ[k] for k in expected} == expected


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"},  # the batch script itself, not an srun step
    {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", "RANK": "3", "WORLD_SIZE": "8"},  # torchrun
])
def test_slurm_variables_are_left_alone_outside_an_srun_task(launch_env, env):
    launch_env(**env)
    assert models.training.distributed.slurm_env() == {}
    assert dist_info() == DistInfo(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)))


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node1,node2", "node1"), ("gpu[003-005,010],cpu1", "gpu003"),
    ("rack[1-2]-n[07-08]", "rack1-n07"), ("a[12,3]", "a12"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert models.training.distributed.first_host(nodelist) == first


def test_resume_auto_continues_the_newest_run_of_the_experiment(compose_cfg, tmp_path, caplog):
    """The newest checkpoint by time across the experiment's run directories (not the highest step)."""
    exp = tmp_path / "outputs" / "in2"
    overrides = [*TINY, "trainer.max_steps=3", "trainer.resume_from=auto"]
    with caplog.at_level(logging.INFO, logger="train"):
        train.run(compose_cfg(*TINY, "trainer.max_steps=2", "trainer.save_every=1", "trainer.resume_from=auto"),
                  exp / "a")
    assert "no checkpoint of any default run under" in caplog.text  # the first run started fresh
    shutil.copytree(exp / "a", exp / "b")
    shutil.rmtree(exp / "b" / "checkpoints" / "step-2")
    newest = exp / "b" / "checkpoints" / "step-1"
    now = time.time() + 10
    os.utime(newest / "trainer_state.json", (now, now))
    state = train.setup(train.as_train_config(compose_cfg(*overrides)), exp / "c")
    try:
        assert state.checkpoint == newest and state.start_step == 1
    finally:
        train.cleanup(state)


def test_resume_latest_in_a_fresh_run_directory_points_at_auto(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint under .*trainer.resume_from=auto"):
        resolve_checkpoint("latest", tmp_path / "fresh")
    assert resolve_checkpoint("auto", tmp_path / "fresh") is None
