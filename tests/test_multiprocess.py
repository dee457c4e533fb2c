"""Multi-host launch, tested with several processes on one machine: two processes with two CPU devices
each (jax.distributed.initialize through `experiments.train --coordinator_address`, gloo collectives)
must train exactly like one process with four devices, and only process 0 may write logs."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
OVERRIDES = [
    "--config=configs/tiny_cpu.py",
    f"--config.train.num_steps={STEPS}", "--config.train.log_every=1", "--config.train.eval_every=3",
    "--config.train.eval_batches=1", "--config.train.progress_bar=False",
    "--config.train.tensorboard=False", "--config.train.plot=False",
    "--config.model.n_layers=1", "--config.model.d_model=64", "--config.model.ffn_dim=128",
    "--config.data.seq_len=128", "--config.model.max_seq_len=128", "--config.data.global_batch_size=8",
    "--config.data.max_bytes=200000", "--config.checkpoint.async_save=False",
    "--config.mesh.data=2", "--config.mesh.fsdp=2",
]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices):
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
  return env


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _run_two_processes(workdir, *extra, timeout=600):
  """Runs experiments.train as 2 processes x 2 CPU devices; returns their (stdout, stderr)."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *OVERRIDES, *extra, f"--workdir={workdir}",
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
      cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail(f"multi-process run did not finish in {timeout} s (a hang between processes?)")
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{err[-3000:]}"
  return outs


def test_two_processes_stop_together_at_the_time_limit(tmp_path):
  # Each process has its own clock: unless the processes agree on the time limit too, one of them
  # validates (a collective) while the other has left the loop, and both hang.
  outs = _run_two_processes(str(tmp_path / "limit"), "--config.train.num_steps=100000",
                            "--config.train.time_limit_minutes=0.15", timeout=300)
  out, err = outs[0]  # only process 0 prints; both exited with status 0 (checked above)
  assert "time limit: saved step" in out + err, (out + err)[-2000:]
  with open(os.path.join(str(tmp_path / "limit"), "metrics.jsonl")) as f:
    ends = [json.loads(line) for line in f if '"event": "end"' in line]
  assert [e["stopped"] for e in ends] == ["time limit"], ends


def test_two_processes_match_one_process(tmp_path):
  single = str(tmp_path / "single")
  r = subprocess.run([sys.executable, "-m", "experiments.train", *OVERRIDES, f"--workdir={single}"],
                     cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]

  multi = str(tmp_path / "multi")
  _run_two_processes(multi)
  a, b = _losses(single), _losses(multi)
  assert sorted(a) == sorted(b) and len(a) >= STEPS, (a, b)
  for step in a:
    assert abs(a[step] - b[step]) <= 1e-4 * max(1.0, abs(a[step])), (step, a[step], b[step])
  # Process 1 wrote no log of its own: the one metrics file has each step once.
  with open(os.path.join(multi, "metrics.jsonl")) as f:
    steps = [json.loads(line).get("step") for line in f if '"train/loss"' in line]
  assert len(steps) == len(set(steps)), steps
