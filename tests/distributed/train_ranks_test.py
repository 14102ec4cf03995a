#!/usr/bin/env python3
"""kiln train under kiln launch, end to end (the CLI, the launcher, the process group, the engine):

  match     for each model and --shard mode, N ranks on the global batch end with the losses and
            the (consolidated) params of one process, within float32 tolerance;
  disagree  ranks given different batches stop at start-up with one clear error, no hang;
  fault     a rank killed mid-run: the launcher exits non-zero within 60 s naming the lost rank,
            and the last checkpoint stays whole.
  nodes     2 nodes x P processes (two kiln launch --nnodes 2 --node-rank R on this machine; P is
            --per-node, 2 by default) end with the losses and params of 2P processes of one node.
  launchers the same run started by kiln launch, by torchrun (--no-python; skipped without it) and
            as Slurm's srun starts tasks (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST, ...; no
            torchrun variables): the same losses and params, bit for bit.
  restart   kiln launch --max-restarts 1 with a rank killed mid-run: the group restarts from its
            last checkpoint and ends with the params of a run never interrupted, bit for bit (on
            GPUs within --tolerance, reported as such, where the bits differ); with
            --min-nproc 1 (the killed rank's slot left out, the run goes on alone) those of 2
            ranks to the checkpoint's step and one process from there.

CI runs it on the CPU (Gloo); scripts/gpu-dist-check.sh runs it with --device cuda (NCCL) on 2
and 4 GPUs. Needs numpy and safetensors (scripts/install-deps.sh installs them); skips without.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
    from safetensors.numpy import load_file
except ImportError:  # pragma: no cover
    print("SKIP: numpy or safetensors missing")
    sys.exit(0)


def run(cmd, timeout=600, env=None):
    started = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.time() - started


# Params: |got - want| <= TOLERANCE + 1e-5 |want|. AdamW steps an element whose gradient is within
# rounding of zero (attention's key bias: zero in exact arithmetic) by up to lr either way, so the
# default is 10% of the runs' lr (3e-3).
TOLERANCE = 3e-4
AMP = "off"


def train_args(model, steps, batch, device, extra):
    args = ["train", "--model", model, "--steps", str(steps), "--batch", str(batch), "--device", device, "--amp", AMP,
            "--eval-every", str(steps), "--eval-batches", "2", "--log-every", "1", "--seed", "3", "--lr", "3e-3"]
    if model.startswith(("gpt2", "llama")):
        args += ["--seq", "32"]
    return args + extra


def losses_of(output):
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", output)]


def check_match(kiln, device, ranks, models, modes):
    failures = 0
    for model in models:
        steps, batch = 8, 12
        with tempfile.TemporaryDirectory() as one_dir:
            p, _ = run([kiln] + train_args(model, steps, batch, device, ["--checkpoint-dir", one_dir]))
            if p.returncode != 0:
                print(p.stdout, p.stderr)
                raise SystemExit(f"FAIL: one process of {model} failed")
            want = load_file(os.path.join(one_dir, "last.safetensors"))
            want_losses = losses_of(p.stdout)
            for mode in modes:
                with tempfile.TemporaryDirectory() as d:
                    p, seconds = run([kiln, "launch", "-n", str(ranks), "--"] +
                                     train_args(model, steps, batch, device,
                                                ["--shard", mode, "--checkpoint-dir", d, "--consolidate"]))
                    name = f"{model} {ranks} ranks {mode}"
                    if p.returncode != 0:
                        print(p.stdout[-3000:], p.stderr[-3000:])
                        print(f"FAIL: {name}: exit {p.returncode}")
                        failures += 1
                        continue
                    got = load_file(os.path.join(d, "consolidated.safetensors"))
                    got_losses = losses_of(p.stdout)
                    worst = 0.0
                    for key, w in want.items():
                        g = got[key]
                        assert g.shape == w.shape, (name, key, g.shape, w.shape)
                        # float32 tolerance: the ranks' means of means differ from one mean in the last bits.
                        err = float(np.max(np.abs(g.astype(np.float64) - w) / (TOLERANCE + 1e-5 * np.abs(w)))) if w.size else 0
                        worst = max(worst, err)
                    loss_err = max(abs(a - b) for a, b in zip(got_losses, want_losses)) if want_losses else 0
                    ok = worst <= 1.0 and loss_err <= 2e-4 and len(got_losses) == len(want_losses)
                    print(f"{'ok  ' if ok else 'FAIL'} {name}: params max scaled error {worst:.3f}, "
                          f"loss max diff {loss_err:.2e} over {len(got_losses)} lines, {seconds:.1f} s")
                    failures += 0 if ok else 1
    return failures


def check_disagree(kiln, device):
    # Rank 1 gets another batch: its compiled step differs, and start-up says so. (gpt2-tiny: its
    # text ships with kiln; the GPU machine has no Fashion-MNIST.)
    script = (f'b=4; [ "$RANK" = 1 ] && b=2; exec {kiln} ' + " ".join(train_args("gpt2-tiny", 4, 0, device, [])).replace(
        "--batch 0", "--batch $b"))
    p, seconds = run([kiln, "launch", "-n", "2", "--", "sh", "-c", script], timeout=120)
    text = p.stdout + p.stderr
    ok = p.returncode != 0 and "disagrees with rank 0" in text and seconds < 90
    print(f"{'ok  ' if ok else 'FAIL'} disagreeing ranks: exit {p.returncode} in {seconds:.1f} s")
    if not ok:
        print(text[-3000:])
    return 0 if ok else 1


def check_fault(kiln, device):
    with tempfile.TemporaryDirectory() as d:
        cmd = [kiln, "launch", "-n", "2", "--"] + train_args("gpt2-tiny", 100000, 4, device,
                                                             ["--checkpoint-dir", d])
        cmd[cmd.index("--eval-every") + 1] = "5"
        launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        checkpoint = os.path.join(d, "last.rank0-of-2.safetensors")
        deadline = time.time() + 120
        while not os.path.exists(checkpoint) and time.time() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        if not os.path.exists(checkpoint):
            launcher.kill()
            print("FAIL: no checkpoint appeared", launcher.communicate()[0][-3000:])
            return 1
        time.sleep(1.0)
        # Rank 1: the launcher's child whose environment says RANK=1.
        victim = None
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != launcher.pid:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if b"RANK=1" in f.read().split(b"\0"):
                        victim = int(pid)
            except (OSError, IndexError, ValueError):
                continue
        if victim is None:
            launcher.kill()
            print("FAIL: rank 1's process not found")
            return 1
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        try:
            output, _ = launcher.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            launcher.kill()
            print("FAIL: the launcher still runs 90 s after rank 1 was killed")
            return 1
        seconds = time.time() - killed_at
        intact = True
        try:
            load_file(checkpoint)
        except Exception as e:  # noqa: BLE001
            intact = False
            print("checkpoint unreadable:", e)
        ok = launcher.returncode != 0 and "rank 1" in output and seconds < 60 and intact
        print(f"{'ok  ' if ok else 'FAIL'} rank 1 killed: launcher exit {launcher.returncode} after {seconds:.1f} s, "
              f"checkpoint {'intact' if intact else 'BROKEN'}")
        print("  " + "\n  ".join(output.strip().splitlines()[-4:]))
        return 0 if ok else 1


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_scaled_error(want, got):
    worst = 0.0
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape, (key, g.shape, w.shape)
        if w.size:
            worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - w) / (TOLERANCE + 1e-5 * np.abs(w)))))
    return worst


def node_env(device, node, per_node):
    """On GPUs the two "nodes" share one machine: node R takes GPUs P R .. P R + P - 1 (LOCAL_RANK 0 ..
    P - 1), so that no GPU has two ranks (NCCL refuses that)."""
    if device != "cuda":
        return None
    return dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(per_node * node + i) for i in range(per_node)))


def check_nodes(kiln, device, per_node):
    model, steps, batch = "llama-tiny", 6, 8
    world = 2 * per_node
    with tempfile.TemporaryDirectory() as one_node, tempfile.TemporaryDirectory() as two_nodes:
        p, _ = run([kiln, "launch", "-n", str(world), "--"] +
                   train_args(model, steps, batch, device, ["--shard", "zero3", "--checkpoint-dir", one_node,
                                                            "--consolidate"]))
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:])
            print(f"FAIL: {world} processes of one node")
            return 1
        want_losses = losses_of(p.stdout)
        port = str(free_port())
        nodes = [subprocess.Popen([kiln, "launch", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                                   "127.0.0.1", "--master-port", port, "-n", str(per_node), "--"] +
                                  train_args(model, steps, batch, device, ["--shard", "zero3", "--checkpoint-dir",
                                                                           two_nodes, "--consolidate"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=node_env(device, node, per_node)) for node in (0, 1)]
        outputs = [n.communicate(timeout=300) for n in nodes]
        if any(n.returncode != 0 for n in nodes):
            for out, err in outputs:
                print(out[-2000:], err[-2000:])
            print(f"FAIL: 2 nodes x {per_node} processes: exit", [n.returncode for n in nodes])
            return 1
        got_losses = losses_of(outputs[0][0])
        worst = max_scaled_error(load_file(os.path.join(one_node, "consolidated.safetensors")),
                                 load_file(os.path.join(two_nodes, "consolidated.safetensors")))
        ok = got_losses == want_losses and len(got_losses) > 0 and worst <= 1.0 and f"{world} ranks" in outputs[0][0]
        print(f"{'ok  ' if ok else 'FAIL'} 2 nodes x {per_node} processes vs {world} of one node ({model}, zero3): "
              f"losses {'equal' if got_losses == want_losses else 'DIFFER'} over {len(got_losses)} lines, "
              f"params max scaled error {worst:.3f}")
        return 0 if ok else 1


# The venv's torchrun (scripts/install-deps.sh), else the one on PATH (a GPU machine's PyTorch).
TORCHRUN = "/opt/kiln-venv/bin/torchrun" if os.path.exists("/opt/kiln-venv/bin/torchrun") else shutil.which("torchrun")
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT")


def check_launchers(kiln, device):
    model, steps, batch = "llama-tiny", 6, 8
    args = lambda d: train_args(model, steps, batch, device, ["--shard", "zero2", "--checkpoint-dir", d,
                                                              "--consolidate"])
    # One OpenMP thread a rank in every run (torchrun's default): CPU kernels sum in the same order.
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    clean["OMP_NUM_THREADS"] = "1"
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        p, _ = run([kiln, "launch", "-n", "2", "--"] + args(d), env=clean)
        runs["kiln launch"] = (p, d)
        if p.returncode == 0:
            want = load_file(os.path.join(d, "consolidated.safetensors"))
    if runs["kiln launch"][0].returncode != 0:
        p = runs["kiln launch"][0]
        print(p.stdout[-2000:], p.stderr[-2000:])
        print("FAIL: kiln launch -n 2")
        return 1
    want_losses = losses_of(runs["kiln launch"][0].stdout)
    failures = 0
    for name in ("torchrun", "srun"):
        with tempfile.TemporaryDirectory() as d:
            if name == "torchrun":
                if not TORCHRUN:
                    print("skip torchrun: none installed")
                    continue
                p, _ = run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "--no-python", kiln] +
                           args(d), env=clean)
                output = p.stdout
                ok_exit = p.returncode == 0
            else:
                # What srun gives each task of `srun -N1 -n2` on this host.
                port = free_port()
                tasks = [subprocess.Popen([kiln] + args(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=dict(clean, SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                                                   SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE="2",
                                                   SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
                                                   SLURM_JOB_ID=str(port - 29500) if port > 29500 else "0",
                                                   MASTER_PORT=str(port)))
                         for rank in (0, 1)]
                outs = [t.communicate(timeout=300) for t in tasks]
                output = outs[0][0]
                ok_exit = all(t.returncode == 0 for t in tasks)
                p = subprocess.CompletedProcess([], tasks[0].returncode, outs[0][0], outs[0][1] + outs[1][1])
            if not ok_exit:
                print(p.stdout[-2000:], p.stderr[-2000:])
                print(f"FAIL: {name}: exit {p.returncode}")
                failures += 1
                continue
            got = load_file(os.path.join(d, "consolidated.safetensors"))
            same, how = same_params(want, got, device)
            losses = losses_of(output)
            ok = same and losses == want_losses and "2 ranks" in output
            print(f"{'ok  ' if ok else 'FAIL'} {name}: losses {'equal' if losses == want_losses else 'DIFFER'}, params "
                  f"{how} as kiln launch -n 2")
            failures += 0 if ok else 1
    return failures


def rank_pid(launcher, rank):
    """The pid of the launcher's child whose environment says RANK=rank."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher.pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except (OSError, IndexError, ValueError):
            continue
    return None


def same_params(want, got, device):
    """(ok, text): bit for bit; on GPUs within TOLERANCE also passes, and says so (a restarted
    process may pick other kernels' algorithms, e.g. cuDNN's, than the run it replaces)."""
    if all(np.array_equal(want[k], got[k]) for k in want):
        return True, "bit for bit"
    worst = max_scaled_error(want, got)
    if device == "cuda" and worst <= 1.0:
        return True, f"within tolerance (max scaled error {worst:.3f}), not bit for bit"
    return False, f"DIFFER (max scaled error {worst:.3f})"


def show_log(name, output):
    """The launcher's and the ranks' lines, but only every 20th step line and those next to a restart."""
    lines = output.splitlines()
    keep = set()
    for i, line in enumerate(lines):
        step = re.search(r"step +(\d+)/", line)
        if not step or int(step.group(1)) % 20 == 0:
            keep.add(i)
        if "kiln launch" in line or "restart" in line:
            keep.update(range(max(0, i - 2), min(len(lines), i + 3)))
    print(f"---- log: {name} ----")
    for i in sorted(keep):
        print(lines[i])
    print("---- end of log ----")


def check_restart(kiln, device, steps=120, log=False):
    model, batch = "llama-tiny", 4
    failures = 0
    with tempfile.TemporaryDirectory() as whole_dir:
        # The schedule's length fixed, so that a run of fewer --steps reaches a step on the same lr.
        extra = ["--shard", "zero2", "--checkpoint-dir", whole_dir, "--consolidate", "--decay-steps", str(steps)]
        args = train_args(model, steps, batch, device, extra)
        args[args.index("--eval-every") + 1] = "10"
        p, _ = run([kiln, "launch", "-n", "2", "--"] + args)
        losses = losses_of(p.stdout)
        if p.returncode != 0 or not losses or losses[0] - losses[-1] < 0.1:
            print(p.stdout[-3000:], p.stderr[-3000:])
            print("FAIL: the uninterrupted run (or its loss did not move)")
            return 1
        want = load_file(os.path.join(whole_dir, "consolidated.safetensors"))
        for shrink in (False, True):
            with tempfile.TemporaryDirectory() as d:
                args[args.index("--checkpoint-dir") + 1] = d
                launcher = subprocess.Popen([kiln, "launch", "-n", "2", "--max-restarts", "1"] +
                                            (["--min-nproc", "1"] if shrink else []) + ["--"] + args,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                checkpoint = os.path.join(d, "last.rank1-of-2.safetensors")
                deadline = time.time() + 120
                while not os.path.exists(checkpoint) and time.time() < deadline and launcher.poll() is None:
                    time.sleep(0.05)
                victim = rank_pid(launcher, 1)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                try:
                    output, _ = launcher.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    launcher.kill()
                    output = launcher.communicate()[0]
                name = f"rank 1 killed, --max-restarts 1{' --min-nproc 1' if shrink else ''}"
                resumed = re.search(r"restart 1: resumed from .* at step (\d+)", output)
                restarted = "restarting the group (1 of at most 1)" in output
                if log:
                    show_log(name, output)
                if launcher.returncode != 0 or victim is None or not resumed or not restarted:
                    print(output[-4000:])
                    print(f"FAIL: {name}: exit {launcher.returncode}, killed {victim}, restarted {restarted}, "
                          f"resumed {bool(resumed)}")
                    failures += 1
                    continue
                got = load_file(os.path.join(d, "consolidated.safetensors"))
                step = int(resumed.group(1))
                if shrink:
                    # What it should equal: 2 ranks to that step, then one process from their
                    # checkpoint, uninterrupted (float32 runs at other world sizes part ways
                    # over 100 steps: no tolerance holds against 2 ranks all the way).
                    with tempfile.TemporaryDirectory() as ref:
                        first = list(args)
                        first[first.index("--steps") + 1] = str(step)
                        first[first.index("--checkpoint-dir") + 1] = ref
                        rest = list(args)
                        rest[rest.index("--checkpoint-dir") + 1] = ref
                        rest[rest.index("--shard") + 1] = "auto"
                        p1, _ = run([kiln, "launch", "-n", "2", "--"] + first)
                        p2, _ = run([kiln] + rest + ["--resume"])
                        if p1.returncode != 0 or p2.returncode != 0:
                            print(p1.stdout[-2000:], p1.stderr[-2000:], p2.stdout[-2000:], p2.stderr[-2000:])
                        want_here = load_file(os.path.join(ref, "consolidated.safetensors"))
                    same, how = same_params(want_here, got, device)
                    ok = same and "on 1 process" in output
                    detail = f"params {how} as 2 ranks to step {step} then one process uninterrupted"
                else:
                    ok, how = same_params(want, got, device)
                    detail = f"params {how} as uninterrupted"
                print(f"{'ok  ' if ok else 'FAIL'} {name}: resumed at step {resumed.group(1)} of {steps}, {detail}")
                failures += 0 if ok else 1
    return failures


def main():
    global TOLERANCE, AMP
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--models", default="mlp,gpt2-tiny")
    ap.add_argument("--modes", default="dp,zero1,zero2,zero3")
    ap.add_argument("--checks", default="match,disagree,fault,nodes,launchers,restart")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="params: |got - want| <= tol + 1e-5 |want| (losses, printed to 4 places: within 2e-4)")
    ap.add_argument("--amp", default=AMP)
    ap.add_argument("--restart-steps", type=int, default=120,
                    help="restart: the run's steps (a checkpoint every 10; more where steps are fast, e.g. on GPUs, "
                         "so that the rank is killed mid-run)")
    ap.add_argument("--show-log", action="store_true", help="restart: print the restarted runs' logs")
    ap.add_argument("--per-node", type=int, default=2,
                    help="nodes: processes a node (on GPUs: half the GPUs, one each)")
    a = ap.parse_args()
    TOLERANCE, AMP = a.tolerance, a.amp
    failures = 0
    checks = a.checks.split(",")
    if "match" in checks:
        failures += check_match(a.kiln, a.device, a.ranks, a.models.split(","), a.modes.split(","))
    if "disagree" in checks:
        failures += check_disagree(a.kiln, a.device)
    if "fault" in checks:
        failures += check_fault(a.kiln, a.device)
    if "nodes" in checks:
        failures += check_nodes(a.kiln, a.device, a.per_node)
    if "launchers" in checks:
        failures += check_launchers(a.kiln, a.device)
    if "restart" in checks:
        failures += check_restart(a.kiln, a.device, a.restart_steps, a.show_log)
    print("all passed" if failures == 0 else f"{failures} FAILED")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
