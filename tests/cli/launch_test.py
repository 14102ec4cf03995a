#!/usr/bin/env python3
"""`kiln launch` (tools/cli/launch.cc) run as a user runs it: N processes of a shell command with
torchrun's variables, output prefixed per rank without broken lines, a failed or killed rank
named and the others ended (their pids gone), SIGTERM to the launcher passed on, bad input
refused with one line, a kiln command run by the same kiln, node ranks (--nnodes), restarts
(--max-restarts, --min-nproc), and `kiln train --metrics` written by rank 0 alone (Gloo, CPU).

  python3 tests/cli/launch_test.py PATH/TO/kiln      (ctest: cli/launch)
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

KILN = None
CHECKS = 0


def check(condition, what, result=None):
    global CHECKS
    CHECKS += 1
    if not condition:
        detail = ""
        if result is not None:
            detail = f"\n  exit code {result.returncode}\n  stdout: {result.stdout!r}\n  stderr: {result.stderr!r}"
        raise AssertionError(what + detail)


def launch(*args, env=None, timeout=30):
    """Runs `kiln launch ARGS`; returns (completed process, seconds it took)."""
    start = time.monotonic()
    result = subprocess.run([KILN, "launch", *args], capture_output=True, text=True, env=env, timeout=timeout)
    return result, time.monotonic() - start


def is_gone(pid):
    """True once `pid` runs no more (a zombie left to an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for_files(paths, seconds=10):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) and open(p).read().strip() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"these files never appeared: {paths}")
        time.sleep(0.02)


def read_pids(directory):
    pids = []
    for name in os.listdir(directory):
        if name.startswith("pid."):
            pids.append(int(open(os.path.join(directory, name)).read()))
    return pids


# A rank's shell records its own pid and a child's (sleep), so the test can see both are ended.
RECORD_PIDS = 'echo $$ > {d}/pid.sh.$RANK; sleep 600 & echo $! > {d}/pid.sleep.$RANK; '


def test_variables_and_prefixes():
    env = dict(os.environ, NCCL_NVLS_ENABLE="1", RANK="99")  # forced and replaced
    result, _ = launch("-n", "3", "--", "sh", "-c",
                       "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
                       "$NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS; "
                       "echo on-stderr-$RANK >&2", env=env)
    check(result.returncode == 0, "3 ranks that exit 0: the launcher exits 0", result)
    lines = result.stdout.splitlines()
    check(len(lines) == 3, "one stdout line per rank", result)
    pattern = re.compile(r"^(?:\[rank (\d)\] )?(\d)/3/(\d)/3 127\.0\.0\.1 (\d+) 0 1 1$")
    ports = set()
    for line in lines:
        match = pattern.match(line)
        check(match is not None, f"line {line!r} has the rank's variables", result)
        prefix, rank, local_rank, port = match.groups()
        check(rank == local_rank and (prefix == rank if rank != "0" else prefix is None),
              f"line {line!r}: rank 0 unprefixed, the others '[rank r] '", result)
        ports.add(int(port))
    check(sorted(re.match(r"^(?:\[rank \d\] )?(\d)", l).group(1) for l in lines) == ["0", "1", "2"],
          "ranks 0, 1, 2 each ran once", result)
    check(len(ports) == 1 and 0 < ports.pop() < 65536, "one MASTER_PORT for all ranks", result)
    check(sorted(result.stderr.splitlines()) == ["[rank 1] on-stderr-1", "[rank 2] on-stderr-2", "on-stderr-0"],
          "stderr lines go to stderr, prefixed the same way", result)


def test_lines_stay_whole():
    # Two ranks write many long lines at once, and one line in two pieces: none is cut or mixed.
    body = "x" * 200
    result, _ = launch("-n", "2", "--", "sh", "-c",
                       f"i=0; while [ $i -lt 1500 ]; do echo $RANK:$i:{body}; i=$((i+1)); done; "
                       "printf 'half-'; sleep 0.2; printf 'line\\n'; printf 'no newline at the end'")
    check(result.returncode == 0, "the writers exit 0", result)
    lines = result.stdout.splitlines()
    for rank, prefix in (("0", ""), ("1", "[rank 1] ")):
        mine = [l for l in lines if l.startswith(prefix + rank + ":")]
        check(mine == [f"{prefix}{rank}:{i}:{body}" for i in range(1500)],
              f"rank {rank}'s 1500 lines arrive whole and in order")
        check(lines.count(prefix + "half-line") == 1, f"rank {rank}'s line written in two pieces arrives whole")
        check(lines.count(prefix + "no newline at the end") == 1, f"rank {rank}'s last bytes without a newline")
    check(len(lines) == 2 * 1502, "no other lines", result)


def test_failed_rank_ends_the_others():
    with tempfile.TemporaryDirectory() as d:
        script = (RECORD_PIDS.format(d=d) +
                  f'if [ $RANK = 1 ]; then while [ ! -s {d}/pid.sleep.0 ] || [ ! -s {d}/pid.sleep.2 ]; do sleep 0.02; '
                  'done; echo "an earlier line" >&2; echo "boom on rank 1" >&2; exit 3; fi; wait')
        result, seconds = launch("-n", "3", "--grace", "1", "--", "sh", "-c", script)
        check(result.returncode == 3, "the launcher exits with the failed rank's code", result)
        check("kiln launch: rank 1 failed (exit code 3): boom on rank 1\n" in result.stderr,
              "one line names the rank, its code and its last stderr line", result)
        check(seconds < 1 + 4, f"the launcher ends within the grace and a few seconds (took {seconds:.1f} s)", result)
        pids = read_pids(d)
        check(len(pids) == 6, "every rank recorded its shell's and its sleep's pid")
        deadline = time.monotonic() + 2
        while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        check(all(is_gone(p) for p in pids), f"no rank or rank's child is left running: {pids}")


def test_killed_rank_is_named():
    script = 'if [ $RANK = 1 ]; then echo "about to die" >&2; kill -9 $$; fi; sleep 600'
    result, seconds = launch("-n", "2", "--grace", "1", "--", "sh", "-c", script)
    check(result.returncode == 128 + 9, "a rank killed by SIGKILL: the launcher exits 137", result)
    check("kiln launch: rank 1 failed (killed by signal 9, SIGKILL): about to die\n" in result.stderr,
          "the line names the rank and the signal", result)
    check(seconds < 1 + 4, f"ended within the grace and a few seconds (took {seconds:.1f} s)", result)


def test_rank_that_ignores_sigterm_is_killed():
    with tempfile.TemporaryDirectory() as d:
        script = (f'if [ $RANK = 1 ]; then while [ ! -e {d}/ready ]; do sleep 0.02; done; exit 2; fi; '
                  f'trap "" TERM; echo $$ > {d}/pid.0; touch {d}/ready; while :; do sleep 0.1; done')
        result, seconds = launch("-n", "2", "--grace", "0", "--", "sh", "-c", script)
        check(result.returncode == 2, "the failed rank's code", result)
        check("kiln launch: rank 0 still running 5 s after SIGTERM: killing it" in result.stderr,
              "a rank that outlives SIGTERM is named and killed", result)
        check(4.5 < seconds < 5 + 4, f"SIGKILL comes 5 s after SIGTERM (took {seconds:.1f} s)", result)
        check(all(is_gone(p) for p in read_pids(d)), "the rank is gone")


def test_sigterm_to_the_launcher_ends_every_rank():
    with tempfile.TemporaryDirectory() as d:
        launcher = subprocess.Popen([KILN, "launch", "-n", "2", "--", "sh", "-c", RECORD_PIDS.format(d=d) + "wait"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_files([f"{d}/pid.{what}.{rank}" for what in ("sh", "sleep") for rank in (0, 1)])
        launcher.send_signal(signal.SIGTERM)
        start = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=10)
        seconds = time.monotonic() - start
        check(launcher.returncode == 128 + 15, f"exit code 143 after SIGTERM, got {launcher.returncode}: {stderr!r}")
        check("kiln launch: SIGTERM: passing it to every rank" in stderr, f"it says so: {stderr!r}")
        check(seconds < 4, f"the launcher ends at once (took {seconds:.1f} s)")
        pids = read_pids(d)
        deadline = time.monotonic() + 2
        while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        check(len(pids) == 4 and all(is_gone(p) for p in pids), f"every rank and its child are gone: {pids}")


def test_second_node_numbers_its_ranks_after_the_first():
    result, _ = launch("--nnodes", "3", "--node-rank", "1", "--master-addr", "node0", "--master-port", "29999",
                       "-n", "2", "--", "sh", "-c",
                       "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$GROUP_RANK $MASTER_ADDR:$MASTER_PORT")
    check(result.returncode == 0, "node 1's ranks exit 0", result)
    check(sorted(result.stdout.splitlines()) == ["[rank 2] 2/6/0/2/1 node0:29999", "[rank 3] 3/6/1/2/1 node0:29999"],
          "node 1 of 3 runs ranks 2 and 3 of 6, each line prefixed with its global rank", result)


def test_restarts_start_the_group_again():
    # Rank 1 fails on the first start only; the restarted group succeeds.
    script = ('echo start $RANK $TORCHELASTIC_RESTART_COUNT $WORLD_SIZE; '
              'if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 3; fi; sleep 0.2')
    result, _ = launch("-n", "2", "--grace", "1", "--max-restarts", "2", "--", "sh", "-c", script)
    check(result.returncode == 0, "the restarted group succeeds: exit 0", result)
    check("kiln launch: rank 1 failed (exit code 3)" in result.stderr and
          "kiln launch: restarting the group (1 of at most 2) on 2 processes" in result.stderr,
          "the failure and the restart are named", result)
    lines = sorted(result.stdout.splitlines())
    check("start 0 1 2" in lines and "[rank 1] start 1 1 2" in lines and "[rank 1] start 1 0 2" in lines,
          "both ranks start again with TORCHELASTIC_RESTART_COUNT=1", result)
    # Out of restarts: the failed rank's code.
    script = 'if [ $RANK = 1 ]; then exit 4; fi; sleep 600'
    result, _ = launch("-n", "2", "--grace", "0", "--max-restarts", "1", "--", "sh", "-c", script)
    check(result.returncode == 4 and result.stderr.count("rank 1 failed (exit code 4)") == 2 and
          result.stderr.count("restarting the group") == 1, "one restart, then the failed rank's code", result)


def test_min_nproc_leaves_the_failed_slot_out():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5,6")
    script = ('echo $TORCHELASTIC_RESTART_COUNT $RANK/$WORLD_SIZE/$LOCAL_WORLD_SIZE ${CUDA_VISIBLE_DEVICES}; '
              'if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 3; fi; '
              'if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 600; fi')
    result, _ = launch("-n", "3", "--grace", "0", "--max-restarts", "1", "--min-nproc", "2", "--", "sh", "-c", script,
                       env=env)
    check(result.returncode == 0 and "restarting the group (1 of at most 1) on 2 processes" in result.stderr,
          "the group restarts on 2 processes", result)
    restarted = sorted(l for l in result.stdout.splitlines() if re.match(r"^(\[rank \d\] )?1 ", l))
    check(restarted == ["1 0/2/2 4,6", "[rank 1] 1 1/2/2 4,6"],
          "ranks 0 and 1 of 2, on the devices of slots 0 and 2 (the failed slot 1 left out)", result)


def test_bad_input_is_refused_in_one_line():
    for args, expected in ((["-n", "0", "--", "true"], "-n 0: expected 1 to"),
                           (["-n", "100000", "--", "true"], "-n 100000: expected 1 to"),
                           (["-n", "2"], "no command given"),
                           (["-n", "2", "--"], "no command given"),
                           (["-n", "2", "--grace", "-1", "--", "true"], "--grace -1"),
                           (["-n", "2", "--", "launch", "-n", "2", "true"], "cannot be launch itself"),
                           (["-n", "2", "--", "/nonexistent/program"], "cannot run '/nonexistent/program'"),
                           (["--nnodes", "2", "-n", "2", "--", "true"], "--nnodes 2 needs --master-port"),
                           (["--nnodes", "2", "--node-rank", "2", "--master-port", "1", "-n", "2", "--", "true"],
                            "--node-rank 2: expected 0 to 1"),
                           (["-n", "2", "--min-nproc", "3", "--", "true"], "--min-nproc 3: expected 1 to -n 2"),
                           (["--nnodes", "2", "--master-port", "1", "--min-nproc", "1", "-n", "2", "--", "true"],
                            "--min-nproc needs --nnodes 1")):
        result, _ = launch(*args)
        check(result.returncode != 0, f"kiln launch {' '.join(args)}: refused", result)
        check(len(result.stderr.splitlines()) == 1 and expected in result.stderr and result.stdout == "",
              f"kiln launch {' '.join(args)}: one line saying '{expected}'", result)


def test_kiln_command_and_arguments():
    version = subprocess.run([KILN, "version"], capture_output=True, text=True).stdout.splitlines()[0]
    for args in (["-n", "2", "--", "version"], ["-n", "2", "version"]):
        result, _ = launch(*args)
        check(result.returncode == 0, f"kiln launch {' '.join(args)} runs kiln's own command", result)
        lines = result.stdout.splitlines()
        check(version in lines and "[rank 1] " + version in lines, "both ranks printed the version", result)
    # Options after COMMAND are COMMAND's, with or without "--".
    for args in (["-n", "1", "--", "sh", "-c", 'printf "%s\\n" "$*"', "x", "-n", "5", "--grace"],
                 ["-n", "1", "sh", "-c", 'printf "%s\\n" "$*"', "x", "-n", "5", "--grace"]):
        result, _ = launch(*args)
        check(result.returncode == 0 and result.stdout == "-n 5 --grace\n", "the command's own options reach it",
              result)


def test_train_metrics_are_rank_0s():
    """`kiln launch -n 2 -- train --metrics FILE`: rank 0 alone writes FILE (a line per step, not
    one per rank); with --metrics-all-ranks rank 1 writes FILE.rank1 too, the same losses (each
    rank's loss is the group's mean)."""
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "text.txt")
        with open(text, "w") as f:
            f.write(" ".join("".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(1 + i % 7)) for i in range(900)))
        metrics = os.path.join(d, "metrics.jsonl")
        args = ["-n", "2", "--", "train", "--model", "gpt2-tiny", "--data", text, "--seq", "16", "--batch", "4",
                "--steps", "3", "--device", "cpu", "--eval-batches", "1", "--metrics", metrics]
        result, _ = launch(*args, timeout=180)
        check(result.returncode == 0, "kiln train under kiln launch ran", result)
        records = [json.loads(line) for line in open(metrics)]
        check([r["step"] for r in records] == [1, 2, 3], f"one metrics line per step in {metrics}: {records}")
        check(not os.path.exists(metrics + ".rank1"), "no file of rank 1 unless asked")
        os.remove(metrics)
        result, _ = launch(*args, "--metrics-all-ranks", timeout=180)
        check(result.returncode == 0, "kiln train --metrics-all-ranks under kiln launch ran", result)
        rank0 = [json.loads(line) for line in open(metrics)]
        rank1 = [json.loads(line) for line in open(metrics + ".rank1")]
        check([r["step"] for r in rank0] == [1, 2, 3] and [r["step"] for r in rank1] == [1, 2, 3],
              f"each rank's own file, a line per step: {rank0}, {rank1}")
        check([r["loss"] for r in rank0] == [r["loss"] for r in rank1], f"the group's loss on both: {rank0}, {rank1}")
    # Without --metrics there is no FILE for the ranks' files: one line, not a silent no-op.
    alone = subprocess.run([KILN, "train", "--metrics-all-ranks", "--steps", "1"], capture_output=True, text=True,
                           timeout=30)
    check(alone.returncode != 0 and "--metrics-all-ranks requires --metrics" in alone.stdout + alone.stderr,
          "--metrics-all-ranks without --metrics is refused", alone)


def main():
    global KILN
    KILN = os.path.abspath(sys.argv[1])
    tests = [value for name, value in globals().items() if name.startswith("test_")]
    start = time.monotonic()
    for test in tests:
        test()
        print(f"ok  {test.__name__}")
    print(f"{len(tests)} tests, {CHECKS} checks passed in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
