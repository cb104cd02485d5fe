"""`tessera sim` as an operator runs it: the groups simulation through the
command line, with its figures and its refusals."""

import re
import subprocess

import pytest

from conftest import BINARY


def sim(*args):
    return subprocess.run([str(BINARY), "sim", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("protocol", ["quorum", "multi-master"])
def test_slot_migrations_are_simulated_from_the_command_line(protocol):
    result = sim("--protocol", protocol, "--groups", "2", "--seeds", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 seeds" in result.stdout and "0 failed" in result.stdout
    migrations = int(re.search(r"migrations completed (\d+)", result.stdout).group(1))
    assert migrations > 5, result.stdout
    acknowledged = int(re.search(r"acknowledged writes (\d+)", result.stdout).group(1))
    assert acknowledged > 1000, result.stdout


def test_the_groups_simulation_refuses_what_it_does_not_check():
    refused = sim("--protocol", "chain", "--groups", "2", "--transition-to", "quorum", "--seeds", "1")
    assert refused.returncode != 0 and "without --transition-to" in refused.stderr
    refused = sim("--protocol", "chain", "--groups", "2", "--nodes", "2", "--seeds", "1")
    assert refused.returncode != 0 and "--replicas between 1 and --nodes" in refused.stderr
