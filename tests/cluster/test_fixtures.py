"""The test clusters themselves: a SLURM job on both nodes, ssh and pdsh to both addresses."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_a_two_node_sbatch_job_runs_on_node1_and_node2(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={out}", "--time=1",
                               "--wrap", 'srun bash -c \'echo "ran on $SLURMD_NODENAME"\'')
    rec = slurm_cluster.wait_job_state(job, "COMPLETED", timeout=60)
    assert slurm_cluster.hostnames(rec["NodeList"]) == ["node1", "node2"]
    assert sorted(out.read_text().split("\n")[:2]) == ["ran on node1", "ran on node2"], out.read_text()
    assert rec["ExitCode"] == "0:0"


@pytest.mark.slow
def test_ssh_and_pdsh_reach_both_addresses_without_a_prompt(ssh_nodes):
    res = ssh_nodes.ssh("127.0.0.2", 'echo "$SSH_CONNECTION"')
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[2] == "127.0.0.2"  # SSH_CONNECTION: client ip, port, server ip, port
    assert res.stdout.split()[3] == str(ssh_nodes.port)
    res = ssh_nodes.pdsh('echo "$SSH_CONNECTION"')
    assert res.returncode == 0, res.stderr
    by_host = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert {h: v.split()[2] for h, v in by_host.items()} == {"127.0.0.1": "127.0.0.1", "127.0.0.2": "127.0.0.2"}
    assert ssh_nodes.ssh("127.0.0.2", "hostname -I").returncode == 0   # what DeepSpeed's runner asks first
