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


def test_a_failing_seed_names_its_violations_and_how_to_replay_it():
    # No time at all to read keys back after healing: every seed fails its
    # liveness check, and says how to replay it.
    failed = sim("--protocol", "chain", "--seeds", "2", "--liveness-ms", "1", "--safety-ms", "200")
    assert failed.returncode != 0
    assert "FAIL seed 0 faults " in failed.stdout and "  liveness: " in failed.stdout, failed.stdout
    assert "  replay: tessera sim --protocol chain --seed 1" in failed.stdout, failed.stdout
    assert "2 seeds" in failed.stdout and "2 failed" in failed.stdout, failed.stdout
